"""No serving path runs Hugging Face's modules (issue 47): they are the reference in tests and
hold the weights the loader reads, nothing more. With every module of both services' loaded
models made to raise when called (a forward pre-hook on each, recording the call too, so a path
that swallows the error is caught as well), the real services still answer: the producer's
batched prefill and its continuation of a stored prefix, every codec's rebuild (raw, quant,
recompute's span, scd with Patch and Reuse layers), the audit, anchor repair (attention mass,
the exact first layers, the recompute) and verified decoding's exact prefill and check."""

from __future__ import annotations

import contextlib

import pytest

from shared.pb import common_pb2, consumer_pb2, producer_pb2
from tests.conftest import prompt, running_pair
from tests.test_prefill_engine import contexts
from tests.test_scd_service import artifact_dir  # noqa: F401 - fixture

C = 64  # the producer's chunk tokens: the second turn continues the first's stored prefix


@contextlib.contextmanager
def forbidden(*models):
    """While active, calling any module of these loaded models (or modules) raises and is recorded:
    the calls."""
    calls: list[str] = []
    handles = []
    for model in models:
        for name, module in getattr(model, "model", model).named_modules():

            def refuse(module, args, name=name or "model"):
                calls.append(name)
                raise RuntimeError(f"Hugging Face module {name} called on a serving path")

            handles.append(module.register_forward_pre_hook(refuse))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


async def test_no_serving_path_calls_a_hugging_face_module(artifact_dir):  # noqa: F811 - fixture
    path, _ = artifact_dir
    first = contexts(C + 30, seed=11)[0]
    turns = [first, first + contexts(50, seed=12)[0]]
    question = prompt(ids=[17, 42, 99])
    specs = [
        common_pb2.CodecSpec(name="raw"),
        common_pb2.CodecSpec(name="quant", options={"bits": "4"}),
        common_pb2.CodecSpec(name="recompute", options={"start": "1", "end": "3"}),
        common_pb2.CodecSpec(name="scd", options={"schedule": "P.R16.F64.W"}),
        common_pb2.CodecSpec(name="oracle"),
    ]
    async with running_pair(
        "tiny-llama",
        producer_kw={"artifacts": str(path), "chunk_tokens": C},
        consumer_kw={"artifacts": str(path), "prefix_cache_bytes": 0},
    ) as pair:
        with forbidden(pair.producer.servicer.loaded, pair.consumer.servicer.loaded) as calls:
            for spec in specs:
                for ids in turns:
                    got, _, _ = await pair.generate(context=prompt(ids=ids), question=question, max_new_tokens=4, transfer=spec)
                    assert got, spec.name
            raw = common_pb2.CodecSpec(name="raw", options={"repair": "0.3"})
            _, _, stats = await pair.generate(
                context=prompt(ids=turns[1]),
                question=question,
                max_new_tokens=4,
                transfer=raw,
                audit=consumer_pb2.AUDIT_POLICY_REPORT,
                audit_positions=8,
            )
            assert stats.audit_decision and stats.repair_tokens, stats
            both = common_pb2.CodecSpec(name="raw", options={"repair": "0.3", "repair_anchors": "both"})
            _, _, stats = await pair.generate(context=prompt(ids=turns[1]), question=question, max_new_tokens=4, transfer=both)
            assert "layers 0-1" in stats.repair_choice, stats.repair_choice
            _, _, stats = await pair.generate(
                context=prompt(ids=turns[1]),
                question=question,
                max_new_tokens=4,
                transfer=common_pb2.CodecSpec(name="raw"),
                verify=consumer_pb2.VERIFY_POLICY_VERIFIED,
            )
            assert stats.verify_decision.startswith("verified"), stats.verify_decision
            described = await pair.producer_stub.Describe(producer_pb2.ProducerServiceDescribeRequest(), timeout=5)
            assert described.stats.prefill_tokens_reused > 0  # a continuation ran
        assert calls == [], sorted(set(calls))


def test_the_guard_sees_a_hugging_face_forward():
    """The guard itself: a Hugging Face forward under it fails and is recorded (so the test above
    cannot pass by not looking)."""
    import torch

    from shared import kv
    from shared.models import load_model

    loaded = load_model("tiny-llama", "float32", "cpu")
    with forbidden(loaded) as calls:
        with pytest.raises(RuntimeError, match="called on a serving path"):
            kv.prefill_context(loaded, torch.tensor([[5, 6, 7]]))
    assert calls


def test_no_serving_module_imports_the_hf_reference_runner():
    """The Hugging Face runner (consumer.engine.hf_reference) is reachable from tests and benches
    only: importing both services, their engine process and the HTTP endpoint does not load it
    (nor `consumer.engine.runner`, its name while `--engine-forward hf` could select it: this
    fails on that code)."""
    import subprocess
    import sys

    code = (
        "import sys, consumer.server, consumer.__main__, consumer.engine.process, consumer.api.openai_api, producer.server\n"
        "print(sorted(m for m in sys.modules if m.endswith(('hf_reference', 'engine.runner'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
