"""bench.harness.cpu_stages: py-spy's raw stacks into the consumer loop's stages, and per-thread CPU."""

from __future__ import annotations

import os
import threading

from bench.harness import cpu_stages

RAW = """\
thread (10): MainThread;<module> (consumer/__main__.py:10);run (uvloop/__init__.py:92);Runner.run (asyncio/runners.py:118) 50
thread (10): MainThread;Runner.run (asyncio/runners.py:118);pump (consumer/request/transfer.py:200);feed (consumer/link/stream_reader.py:90) 7
thread (10): MainThread;Runner.run (asyncio/runners.py:118);feed (consumer/link/stream_reader.py:90);msg (structlog/_output.py:5) 2
thread (10): MainThread;Runner.run (asyncio/runners.py:118);pump (consumer/request/transfer.py:200);_read (grpc/aio/_call.py:1) 3
thread (10): MainThread;Runner.run (asyncio/runners.py:118);_answer (consumer/pipeline/pipeline.py:400);push_many (consumer/engine/decoding.py:9) 4
thread (11): consumer-engine;_loop (consumer/engine/batch.py:300);forward (consumer/engine/runner.py:150) 90
"""


def test_raw_stacks_into_stages_by_their_innermost_named_frame():
    stages, threads = cpu_stages.parse_raw(RAW)
    assert stages["loop_native"] == 50 and stages["stream_parsing"] == 7 and stages["logging_metrics"] == 2
    assert stages["grpc"] == 3 and stages["answer_streaming"] == 4 and stages["rebuild_dispatch"] == 0
    assert threads == {"MainThread": 66, "consumer-engine": 90}
    split = cpu_stages.split_ms(6.6, stages)
    assert abs(sum(split.values()) - 6.6) < 1e-9 and abs(split["loop_native"] - 5.0) < 1e-9


def test_thread_cpu_and_the_engine_threads_os_name():
    from shared.torch_threads import name_os_thread

    names: dict[int, str] = {}

    def named():
        name_os_thread("consumer-engine")
        names.update(cpu_stages.thread_names(os.getpid()))

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert "consumer-engine" in names.values()
    assert os.getpid() in cpu_stages.thread_cpu_s(os.getpid())


def test_top_counts_project_functions_inclusive_and_innermost_frames_with_lines():
    raw = "\n".join([
        "thread (1): enc;Thread.run (threading.py:982);Continuation._stored (producer/reuse.py:205);_quantize (shared/quantize.py:72) 7",
        "thread (1): enc;Thread.run (threading.py:982);Continuation._stored (producer/reuse.py:206);_quantize (shared/quantize.py:62) 3",
        "thread (2): loop;Runner.run (asyncio/runners.py:118) 4",
        "garbage line",
    ])
    out = cpu_stages.top(raw, n=5)
    assert list(out) == ["enc", "loop"]  # busiest first
    enc = out["enc"]
    assert enc["samples"] == 10
    assert dict(enc["inclusive"]) == {"Continuation._stored (producer/reuse.py)": 10, "_quantize (shared/quantize.py)": 10}
    assert enc["self"][0] == ("_quantize (shared/quantize.py:72)", 7)
    assert out["loop"]["inclusive"] == [] and out["loop"]["self"] == [("Runner.run (asyncio/runners.py:118)", 4)]
