"""The sampler over every parameter value the request schemas accept (consumer.api.job_builder and
openai_schema's ranges, their extremes included): it always draws an id of the vocabulary, never
raises, repeats with its seed, and a temperature under GREEDY_BELOW or a top_p that keeps one
token is the greedy id (after the logit processors)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.engine.decoding import GREEDY_BELOW, Sampler, Sampling

VOCAB = 64
CPU = torch.device("cpu")

temperatures = st.one_of(st.just(0.0), st.floats(0.0, 10.0), st.floats(0.0, 1e-5), st.sampled_from([1e-45, 1e-38, 1e-6, 10.0]))
top_ps = st.one_of(st.just(1.0), st.floats(1.1754944e-38, 1.0), st.sampled_from([1.1754944e-38, 1e-6, 1.0]))
biases = st.lists(st.tuples(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0)), max_size=8, unique_by=lambda p: p[0])
penalties = st.floats(-2.0, 2.0)


def logits_of(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * scale


@settings(max_examples=300, deadline=None)
@given(
    temperature=temperatures,
    top_p=top_ps,
    bias=biases,
    presence=penalties,
    frequency=penalties,
    top_k=st.integers(0, VOCAB + 5),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    seed=st.integers(0, 2**63 - 1),
    scale=st.sampled_from([0.0, 1.0, 30.0, 1e4]),
    steps=st.integers(1, 6),
)
def test_every_accepted_parameter_draws_a_valid_id_and_repeats_with_its_seed(
    temperature, top_p, bias, presence, frequency, top_k, logprobs, seed, scale, steps
):
    sampling = Sampling(temperature, top_p, seed, tuple(bias), presence, frequency, top_k, logprobs)
    draws = []
    for _ in range(2):
        sampler = Sampler(sampling, CPU)
        ids = [sampler(logits_of(step, scale)) for step in range(steps)]
        assert all(0 <= i < VOCAB for i in ids)
        draws.append(ids)
        if logprobs is not None:
            assert [r.id for r in sampler.kept] == ids
    assert draws[0] == draws[1]  # the same seed, the same ids
    if temperature < GREEDY_BELOW:
        assert sampling.temperature == 0.0 and Sampler(sampling, CPU).generator is None


@settings(max_examples=100, deadline=None)
@given(temperature=st.floats(GREEDY_BELOW, 10.0), seed=st.integers(0, 2**63 - 1), scale=st.sampled_from([1.0, 30.0, 1e4]))
def test_a_top_p_that_keeps_one_token_samples_the_greedy_id(temperature, seed, scale):
    row = logits_of(seed % 1000, scale)
    sampler = Sampler(Sampling(temperature, 1.1754944e-38, seed), CPU)
    assert sampler(row) == int(torch.argmax(row))
