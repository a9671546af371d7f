"""`--dtype auto`: bfloat16 only where the device computes it natively (shared.compute_dtype), with
the device facts injected; the chosen dtype and its reason reach load_model, Describe and the log;
an explicit bfloat16 without native support warns with the measured slowdown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import structlog
import torch

from shared import compute_dtype, logs
from shared.compute_dtype import DeviceFacts, choose
from shared.config import ProducerConfig
from shared.models import load_model
from shared.pb import consumer_pb2, producer_pb2
from tests.conftest import real_device_facts, running_pair

AVX2 = frozenset({"fpu", "sse2", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}
AMX = AVX2 | {"amx_tile", "amx_bf16"}
LOWERED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.parametrize(
    "facts, dtype, said",
    [
        (DeviceFacts("cuda", "NVIDIA H200", cuda_bf16=True), "bfloat16", "NVIDIA H200 has native bfloat16"),
        (DeviceFacts("cuda", "Tesla T4", cuda_bf16=False), "float32", "Tesla T4 has no native bfloat16"),
        (DeviceFacts("cpu", cpu_flags=AVX512_BF16, probe_ratio=0.6), "bfloat16", "has avx512_bf16 and"),
        (DeviceFacts("cpu", cpu_flags=AMX, probe_ratio=0.4), "bfloat16", "has amx_bf16 and"),
        # the flags list bf16 but torch runs a lowered ISA (ATEN_CPU_CAPABILITY=avx2): the probe decides
        (DeviceFacts("cpu", cpu_flags=AVX512_BF16, probe_ratio=27.0), "float32", "27.00x float32's time (ISA lowered"),
        # no bf16 instructions: a fast-looking probe (noise) does not make bf16 native
        (DeviceFacts("cpu", cpu_flags=AVX2, probe_ratio=1.0), "float32", "has none of avx512_bf16/amx_bf16/bf16"),
        (DeviceFacts("cpu", cpu_flags=None, probe_ratio=0.7), "bfloat16", "flags are unknown and"),
        (DeviceFacts("cpu", cpu_flags=AVX512_BF16, probe_ratio=None), "float32", "not measured"),
        (DeviceFacts("cpu", cpu_flags=frozenset({"fp", "asimd", "bf16"}), probe_ratio=0.8), "bfloat16", "has bf16 and"),
    ],
)
def test_auto_computes_bf16_only_where_native(facts, dtype, said):
    choice = choose("auto", facts)
    assert choice.dtype == dtype
    assert said in choice.reason and choice.reason.startswith("--dtype auto: ") and choice.reason.endswith(f": {dtype}")
    assert choice.warning == ""


def test_an_explicit_dtype_is_kept_and_bf16_without_native_warns_with_the_ratio():
    slow = DeviceFacts("cpu", cpu_flags=AVX2, probe_ratio=41.7)
    fast = DeviceFacts("cpu", cpu_flags=AVX512_BF16, probe_ratio=0.6)
    for requested in ("float32", "float16"):
        assert choose(requested, slow) == compute_dtype.DtypeChoice(requested, f"--dtype {requested} (explicit)")
    warned = choose("bfloat16", slow)
    assert warned.dtype == "bfloat16" and warned.reason == "--dtype bfloat16 (explicit)"
    assert "measured 41.7x slower than float32" in warned.warning and "--dtype auto would use float32" in warned.warning
    assert choose("bfloat16", fast).warning == ""
    assert choose("bfloat16", DeviceFacts("cuda", "Tesla T4", cuda_bf16=False)).warning


def test_cpu_flags_read_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert compute_dtype.cpu_flags(str(x86)) == {"fpu", "sse2", "avx2", "avx512_bf16"}
    assert compute_dtype.cpu_flags(str(arm)) == {"fp", "asimd", "bf16"}
    assert compute_dtype.cpu_flags(str(tmp_path / "missing")) is None


@pytest.mark.numeric  # make test-lowered-isa runs it under the lowered ISA too
def test_the_real_facts_of_this_cpu_are_consistent():
    facts = real_device_facts(torch.device("cpu"))
    assert facts.device_type == "cpu" and facts.probe_ratio is not None and facts.probe_ratio > 0
    assert choose("auto", facts).dtype in ("bfloat16", "float32")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2":
        assert choose("auto", facts).dtype == "float32", facts  # lowered: bf16 is emulated whatever the flags say


def test_a_lowered_isa_makes_the_probe_choose_float32_even_where_the_flags_list_bf16():
    """The rule's reason for the probe: torch honours the lowered ISA, /proc/cpuinfo does not."""
    flags = compute_dtype.cpu_flags()
    if flags is None or "avx2" not in flags:
        pytest.skip("not an x86 CPU with readable flags")
    code = "import torch; from shared import compute_dtype as c; print(c.probe_ratio())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LOWERED}, capture_output=True, text=True, check=True)
    ratio = float(out.stdout.strip())
    assert ratio > compute_dtype.NATIVE_RATIO, ratio
    assert choose("auto", DeviceFacts("cpu", cpu_flags=flags, probe_ratio=ratio)).dtype == "float32"


def test_the_services_default_is_auto():
    assert ProducerConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype: 'float64'"):
        ProducerConfig(dtype="float64").validate()


@pytest.mark.parametrize(
    "facts, dtype",
    [
        (DeviceFacts("cpu", cpu_flags=AVX2, probe_ratio=30.0), torch.float32),
        (DeviceFacts("cpu", cpu_flags=AMX, probe_ratio=0.5), torch.bfloat16),
    ],
)
def test_load_model_applies_auto_to_the_weights(monkeypatch, facts, dtype):
    monkeypatch.setattr(compute_dtype, "device_facts", lambda device: facts)
    loaded = load_model("tiny-llama", "auto", "cpu")
    assert loaded.dtype == dtype and loaded.info.dtype == str(dtype).removeprefix("torch.")
    assert loaded.info.dtype_reason == choose("auto", facts).reason
    # weight digests are dtype-blind: artifacts calibrated in either dtype still match
    assert loaded.info.weight_digest == load_model("tiny-llama", "float32", "cpu").info.weight_digest


def test_explicit_bf16_without_native_logs_the_measured_slowdown(monkeypatch):
    monkeypatch.setattr(compute_dtype, "device_facts", lambda device: DeviceFacts("cpu", cpu_flags=AVX2, probe_ratio=37.2))
    with structlog.testing.capture_logs() as lines:
        loaded = load_model("tiny-llama", "bfloat16", "cpu")
    assert loaded.info.dtype == "bfloat16"
    (line,) = [x for x in lines if x["event"] == "model.dtype_slow"]
    assert line["log_level"] == "warning" and "measured 37.2x slower than float32" in line["warning"]


async def test_a_service_started_with_auto_describes_the_resolved_dtype_and_why(monkeypatch):
    facts = DeviceFacts("cpu", cpu_flags=AVX512_BF16, probe_ratio=25.0)  # flags say bf16, the (lowered) probe says no
    monkeypatch.setattr(compute_dtype, "device_facts", lambda device: facts)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))  # tests log WARNING
    try:
        with structlog.testing.capture_logs() as lines:
            async with running_pair("tiny-llama", dtype="auto") as pair:
                p = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest())
                c = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
    finally:
        logs.configure("tests", os.environ.get("SCD_TEST_LOG_LEVEL", "WARNING"))
    for model in (p.model, c.model):
        assert model.dtype == "float32"
        assert model.dtype_reason.startswith("--dtype auto: the CPU has avx512_bf16 but a bfloat16 matmul probe took 25.00x")
    serving = [x for x in lines if x["event"] == "server.serving"]
    assert len(serving) == 2 and all(x["dtype"] == "float32" and x["dtype_reason"] == p.model.dtype_reason for x in serving)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_a_cuda_device_follows_its_native_bf16():
    facts = real_device_facts(torch.device("cuda:0"))
    assert facts.device_type == "cuda" and facts.device_name == torch.cuda.get_device_name(0)
    assert facts.cuda_bf16 == (torch.cuda.get_device_capability(0) >= (8, 0))
    assert choose("auto", facts).dtype == ("bfloat16" if facts.cuda_bf16 else "float32")
