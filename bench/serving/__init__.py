"""The pair as real services, each `python -m bench.serving.<name>` (the make targets run them):
throughput, load_test, pool_test, prefix, turns, adaptive (+ mixed), quality, audit, verify,
ttft/ and gpu_check; compose_report judges a `make compose-smoke` run.

May import: bench/harness/, bench/micro/, bench/demo.py, shared, producer, consumer, qa; never
bench/figures/ (it reads the rows these write, and may import their formats and tables).
"""
