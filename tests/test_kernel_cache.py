"""shared.kernel_cache: the services bound oneDNN's caches of compiled kernels, so a process that
sees a new matmul shape with every batch (the consumer under load) stops growing. Measured in
child processes (the caches' sizes are read once, at the first kernel): malloc's in-use bytes
after bfloat16 matmuls of many distinct shapes, with the services' bound and with the libraries'
defaults (the control that shows the test can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared import kernel_cache
from shared.config import ConsumerConfig, ProducerConfig

SHAPES = 300  # distinct M of a [M, 64] x [64, 384] bfloat16 matmul, as an engine forward's token count varies
PROBE = f"""
import json, sys, torch
from shared import heap_trace, kernel_cache
if sys.argv[1] != "defaults":
    kernel_cache.bound(int(sys.argv[1]))
torch.set_num_threads(1)
w = torch.randn(384, 64, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 64, dtype=torch.bfloat16), w)
before = heap_trace.malloc_totals()["in_use"]
for m in range(2, {SHAPES} + 2):
    torch.nn.functional.linear(torch.randn(m, 64, dtype=torch.bfloat16), w)
print(json.dumps({{"grew_mib": (heap_trace.malloc_totals()["in_use"] - before) / 2**20}}))
"""


def grew_mib(setting: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in (kernel_cache.ONEDNN_VAR, kernel_cache.IDEEP_VAR)}
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True, env=env, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["grew_mib"]


def test_the_services_bound_the_kernels_that_distinct_shapes_leave_behind():
    if not hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2) to read malloc's in-use bytes")
    defaults = grew_mib("defaults")
    if defaults < 20:
        pytest.skip(
            f"bfloat16 matmuls here leave {defaults:.1f} MiB behind for {SHAPES} shapes: no oneDNN kernel caching to bound"
        )
    bounded = grew_mib(str(kernel_cache.DEFAULT_ENTRIES))
    # the bound: DEFAULT_ENTRIES kernels of < 0.5 MiB each, whatever the number of shapes seen
    assert bounded < kernel_cache.DEFAULT_ENTRIES * 0.5, (bounded, defaults)
    assert defaults > 2 * bounded  # the libraries' defaults keep a kernel per shape (two caches of 1024)


def test_the_bound_is_set_once_and_the_environment_wins():
    env: dict[str, str] = {}
    said = kernel_cache.bound(64, env)
    assert env == {kernel_cache.ONEDNN_VAR: "64", kernel_cache.IDEEP_VAR: "1"} and "=64" in said
    env = {kernel_cache.ONEDNN_VAR: "512"}
    said = kernel_cache.bound(64, env)
    assert env[kernel_cache.ONEDNN_VAR] == "512" and "set by the environment" in said
    env = {}
    assert "defaults" in kernel_cache.bound(-1, env) and env == {}


def test_both_services_default_to_the_bound():
    assert ConsumerConfig().onednn_cache_entries == ProducerConfig().onednn_cache_entries == kernel_cache.DEFAULT_ENTRIES
    with pytest.raises(ValueError, match="onednn_cache_entries: -2 must be >= -1"):
        ConsumerConfig(onednn_cache_entries=-2).validate()
