"""Safe defaults and budgets as constraints (issue 19, findings 1, 2 and 8; issue 22, item 6): a
request naming no mode gets the consumer's default, `auto` within the pair's default budget
(lossless candidates without an artifact), and readiness follows the safest fixed mode; naive
reuse across different weights only by name; a schedule named with a budget must meet it; small messages name what
to fix."""

from __future__ import annotations

import grpc
import pytest

from consumer.auto.defaults import DefaultMode, safest
from shared.codecs.scd import ScdCodec
from shared.errors import InvalidArgument
from shared.pb import common_pb2, consumer_pb2
from shared.scd.artifact import Artifact
from tests.conftest import perturbed_model, prompt, running_pair

CONTEXT = "The default transfer mode must never give a wrong answer. " * 4


def fake_artifact(producer: str = "p" * 64, consumer: str = "c" * 64) -> Artifact:
    meta = {
        "artifact_id": "a1b2c3d4e5f60718",
        "format_version": 2,
        "producer": {"model_id": "base", "weight_digest": producer},
        "consumer": {"model_id": "tuned", "weight_digest": consumer},
        "geometry": {"num_layers": 2, "hidden": 8, "kv_width": 16, "kv_element_bytes": 2},
        "schedules": [
            {"name": "s0", "schedule": "R2.R2", "loss": 6.63, "bytes_per_token": 8},
            {"name": "s1", "schedule": "R2.R8", "loss": 0.01, "bytes_per_token": 20},
        ],
    }
    return Artifact({}, meta)


def scd_with(*artifacts: Artifact) -> dict:
    codec = ScdCodec.__new__(ScdCodec)  # the default-mode rule reads only the artifacts' metadata
    codec.artifacts = list(artifacts)
    return {"scd": codec, "raw": object()}


def test_safest_default_is_scd_for_a_calibrated_pair_raw_for_equal_weights_else_oracle():
    art = fake_artifact()
    assert safest(scd_with(art), "c" * 64).mode == "scd"  # producer not known yet: the artifact's pair
    assert safest(scd_with(art), "c" * 64, "p" * 64).mode == "scd"
    assert safest(scd_with(art), "c" * 64, "p" * 64, producer_artifacts=()).mode == "oracle"  # not loaded there
    assert safest(scd_with(art), "c" * 64, "x" * 64).mode == "oracle"  # another producer
    assert safest(scd_with(), "c" * 64, "c" * 64).mode == "raw"
    assert safest(scd_with(), "c" * 64, "x" * 64).mode == "oracle"  # never naive reuse by default
    assert safest(scd_with(), "c" * 64).mode == "oracle"  # producer unknown
    configured = DefaultMode("raw", scd_with(), "c" * 64)
    assert not configured.producer_known("x" * 64) and configured.mode == "raw"  # asked for by name


def test_a_named_schedule_must_meet_the_budget_given_with_it():
    art = fake_artifact()
    with pytest.raises(InvalidArgument) as err:
        art.pick("s0", max_loss=0.02)
    assert "schedule 's0'" in str(err.value) and "max_loss 0.02" in str(err.value) and "6.63" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        art.pick("R2.R8", max_bytes=10)
    assert "max_bytes_per_token 10" in str(err.value) and "20 bytes/token" in str(err.value)
    assert art.pick("s1", max_loss=0.02, max_bytes=20).name == "s1"
    with pytest.raises(InvalidArgument, match="not calibrated"):
        art.pick("R8.R8", max_loss=1.0)  # a custom schedule has no calibrated loss to meet a budget with


def test_budget_and_schedule_messages_name_what_to_fix():
    art = fake_artifact()
    with pytest.raises(InvalidArgument) as err:
        art.pick("", max_loss=0.001)
    assert "loss <= 0.001" in str(err.value) and "None" not in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        art.pick("R2")
    assert "2 actions" in str(err.value) and "'R8.R8'" in str(err.value)


async def test_a_request_without_mode_gets_raw_only_for_equal_weights():
    async with running_pair("tiny-llama") as pair:
        described = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
        assert described.default_mode == "auto" and "safest fixed mode now: raw" in described.default_mode_reason
        assert "equal" in described.default_mode_reason and described.producer_link.state == "ok"
        _, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        assert stats.transfer.name in ("raw", "recompute") and stats.bytes_received > 0  # exact with equal weights
        assert stats.auto.exact


async def test_a_request_without_mode_gets_oracle_across_different_weights(tmp_path):
    perturbed_model("tiny-llama", seed=3, scale=0.02, save_to=tmp_path)
    async with running_pair("tiny-llama", consumer_model=str(tmp_path)) as pair:
        described = await pair.stub.Describe(consumer_pb2.ConsumerServiceDescribeRequest())
        assert described.default_mode == "auto" and "differ" in described.default_mode_reason
        fields = dict(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        _, _, stats = await pair.generate(**fields)
        assert stats.transfer.name == "oracle" and stats.bytes_received == 0  # no exact transfer across weights
        assert [c.mode for c in stats.auto.candidates] == ["oracle"]
        _, _, stats = await pair.generate(transfer=common_pb2.CodecSpec(name="raw"), **fields)  # naive reuse, by name
        assert stats.transfer.name == "raw" and stats.bytes_received > 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(transfer=common_pb2.CodecSpec(name="nope"), **fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'oracle'" in err.value.details()


async def test_default_mode_flag_wins():
    async with running_pair("tiny-llama", consumer_kw={"default_mode": "oracle"}) as pair:
        _, _, stats = await pair.generate(context=prompt(CONTEXT), question=prompt(" q"), max_new_tokens=2)
        assert stats.transfer.name == "oracle"
