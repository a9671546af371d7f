"""Tenants (shared.tenants, vLLM's cache_salt): one tenant's stored state is never reused for, nor
its reuse visible to, another's requests, on either service.

The probe of issue 44: after client A prefills a document, client B sends the document's first 32
tokens and one more. On 2cf1243 a right guess answered reused_tokens=32 computed_tokens=1 (a wrong
one 0 / 33): B learned A's context. With another salt, B's right and wrong guesses answer alike,
and Describe shows B none of A's reuse."""

from __future__ import annotations

import grpc
import pytest

from shared import tenants
from shared.pb import common_pb2, producer_pb2
from tests.conftest import prompt, running_pair
from tests.test_prefill_engine import contexts
from tests.test_prefix_service import prefill, producer

RAW = common_pb2.CodecSpec(name="raw")
DOC = contexts(64, seed=101)[0]


async def reuse(stub, salt: str = "") -> producer_pb2.ProducerStats:
    return (await stub.Describe(producer_pb2.ProducerServiceDescribeRequest(cache_salt=salt), timeout=5)).stats


@pytest.mark.parametrize("chunk_tokens", [16, 0], ids=["chunk-store", "whole-context-store"])
async def test_a_probe_of_another_tenants_context_learns_nothing(chunk_tokens):
    right, wrong = DOC[:32] + [7], [(t + 1) % 380 for t in DOC[:32]] + [7]
    async with producer(chunk_tokens=chunk_tokens) as (_, stub):
        await prefill(stub, DOC, spec=RAW, cache_salt="tenant-a")
        await prefill(stub, right if chunk_tokens else DOC, spec=RAW, cache_salt="tenant-a")  # A's own reuse
        answers = {}
        for name, ids in (("right", right), ("wrong", wrong), ("whole", DOC)):  # each a tenant of its own
            _, _, trailer = await prefill(stub, ids, spec=RAW, cache_salt=f"tenant-b-{name}")
            answers[name] = (trailer.store_hit, trailer.reused_tokens, trailer.computed_tokens, trailer.prefill_shared)
        assert answers == {"right": (False, 0, 33, False), "wrong": (False, 0, 33, False), "whole": (False, 0, 64, False)}
        mine, theirs = await reuse(stub, "tenant-b-right"), await reuse(stub, "tenant-a")
        assert (mine.store_hits, mine.store_partial_hits, mine.prefill_tokens_reused, mine.prefill_tokens_computed) == (0, 0, 0, 33)
        assert theirs.prefill_tokens_reused > 0 and (await reuse(stub)).prefill_tokens_reused == 0  # unsalted: a third tenant
        _, _, trailer = await prefill(stub, right if chunk_tokens else DOC, spec=RAW, cache_salt="tenant-a")
        assert trailer.reused_tokens > 0  # the same salt reuses as before


async def test_without_a_salt_the_callers_token_is_the_tenant(tmp_path):
    """A producer with a bearer token files unsalted requests under that token's tenant: apart
    from any salt's; without a token, unsalted requests share one tenant (as before)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    async with producer(chunk_tokens=16, token_file=str(token)) as (server, _):
        channel = grpc.aio.insecure_channel(server.address)
        from shared.pb import producer_pb2_grpc

        stub = producer_pb2_grpc.ProducerServiceStub(channel)
        meta = (("authorization", "Bearer s3cret"),)
        request = producer_pb2.PrefillRequest(token_ids=DOC, codec=RAW)
        first = [m async for m in stub.Prefill(request, timeout=30, metadata=meta)]
        again = [m async for m in stub.Prefill(request, timeout=30, metadata=meta)]
        salted = producer_pb2.PrefillRequest(token_ids=DOC, codec=RAW, cache_salt="x")
        other = [m async for m in stub.Prefill(salted, timeout=30, metadata=meta)]
        await channel.close()
    assert not first[-1].trailer.store_hit and again[-1].trailer.store_hit and not other[-1].trailer.store_hit
    assert tenants.tenant("", "s3cret") not in (tenants.tenant("x", "s3cret"), tenants.tenant("", ""))
    assert tenants.tenant("x", "a") == tenants.tenant("x", "b")  # a salt is the tenant, whatever the token


async def test_a_salt_longer_than_its_limit_is_refused_naming_the_field():
    long = "s" * (tenants.MAX_SALT_BYTES + 1)
    async with running_pair("tiny-llama") as pair:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill(pair.producer_stub, DOC, spec=RAW, cache_salt=long)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pair.generate(context=prompt(ids=DOC), question=prompt(ids=[5]), max_new_tokens=1, cache_salt=long)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"cache_salt: {len(long)} bytes > limit {tenants.MAX_SALT_BYTES}" in err.value.details()


async def test_the_consumers_prefix_cache_and_the_producers_prefix_keys_are_per_tenant():
    """Through the pair (chunks of 32 both sides, raw): a tenant's next turn reuses its own cached
    prefix and asks the producer for the rest only (the prefix key both services compute under the
    tenant agrees: no FAILED_PRECONDITION, fewer bytes); another tenant's same turn reuses nothing
    on either service; the answers are the same tokens."""
    first = contexts(80, seed=111)[0]
    turn = first + contexts(40, seed=112)[0]
    kw = {"chunk_tokens": 32}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw=kw) as pair:
        ask = dict(question=prompt(ids=[17, 42]), max_new_tokens=4, transfer=RAW)
        await pair.generate(context=prompt(ids=first), cache_salt="a", **ask)
        ids_a, _, own = await pair.generate(context=prompt(ids=turn), cache_salt="a", **ask)
        ids_b, _, other = await pair.generate(context=prompt(ids=turn), cache_salt="b", **ask)
        ids_c, _, unsalted = await pair.generate(context=prompt(ids=turn), **ask)
    assert own.prefix_reused_tokens == 64 and own.bytes_received < other.bytes_received
    assert other.prefix_reused_tokens == 0 and not other.producer_store_hit
    assert unsalted.prefix_reused_tokens == 0 and not unsalted.producer_store_hit
    assert ids_a == ids_b == ids_c


async def test_an_http_cache_salt_is_the_tenant_as_over_grpc():
    """vLLM's `cache_salt` body field on the OpenAI port: a tenant's repeated prompt reuses its own
    cached chunks, another salt's same prompt reuses none (same tokens either way); a salt over
    its limit is a 400 naming the field."""
    from tests.http_api import post

    ids = contexts(100, seed=113)[0]
    kw = {"chunk_tokens": 32}
    async with running_pair("tiny-llama", producer_kw=kw, consumer_kw={**kw, "http_port": 0}) as pair:
        body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "scd": {"mode": "raw"}}
        first = await post(pair, "/v1/completions", {**body, "cache_salt": "a"})
        again = await post(pair, "/v1/completions", {**body, "cache_salt": "a"})
        other = await post(pair, "/v1/completions", {**body, "cache_salt": "b"})
        long = await post(pair, "/v1/completions", {**body, "cache_salt": "x" * (tenants.MAX_SALT_BYTES + 1)})
    assert first[0] == again[0] == other[0] == 200, (first, again, other)
    assert first[1]["scd"]["prefix_reused_tokens"] == 0
    assert again[1]["scd"]["prefix_reused_tokens"] == 96
    assert other[1]["scd"]["prefix_reused_tokens"] == 0
    assert first[1]["choices"][0]["text"] == again[1]["choices"][0]["text"] == other[1]["choices"][0]["text"]
    assert long[0] == 400 and long[1]["error"]["param"] == "cache_salt", long
