"""Demo and benchmarks: real services in subprocesses, driven over gRPC, printing JSON lines.

    harness/   what every benchmark runs on: the services as processes, the shaped link (netns,
               tc, relay, link probes), workloads and model scales, the trained pairs, provenance,
               CPU per stage, FLOP counts; imports no other bench package
    micro/     one mechanism alone: gRPC transport, the gRPC call floor, the engine's step, a log
               line's CPU, the batched rebuild's CPU; imports harness/
    serving/   the pair under load: throughput, load and pool tests, prefix reuse and turns, mode
               auto per link, quality, the cache audit, verified decoding, TTFT (ttft/), the GPU check;
               each writes its rows (and prints its own table of them); imports harness/, micro/,
               demo.py, never figures/
    keep/      token selection checked against another implementation (kvpress_check: shared.keep's
               scores against NVIDIA kvpress's presses, `make kvpress-check`); imports harness/
    peer/      this project's services beside another engine on the same checkpoint and prompts
               (vs_vllm: vLLM's CPU build, run in its own venv by vllm_worker.py); imports harness/
    figures/   the committed rows (bench/results/) -> the figures -> docs/results.md and the
               README's generated blocks (`python -m bench.figures.report`); reads the rows serving/
               and peer/ write, with serving/'s own row formats and tables; imports harness/ and serving/
    demo.py    `make demo`; imports harness/

tests/test_consumer_parts.py checks these imports.
"""
