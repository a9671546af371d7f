"""The results documents from the committed rows: reading them (rows.py), every figure the
documents quote (figures.py; serving.py, verify.py, gpu.py per benchmark; plot.py, projection.py),
and docs/results.md, the README's generated blocks and bench/results/quality.md from
bench/templates/ (report.py: `python -m bench.figures.report`, `--check` in the tests); ab.py
compares two sets of throughput rows.

May import: bench/harness/, the serving benchmarks' row formats (bench/serving/), shared, qa.
"""
