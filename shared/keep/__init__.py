"""Token selection: which of a context's tokens a cache keeps (the third compression axis beside
per-token codes and quantization).

Owns the scorers' math (scores.py: streaming, key norm, H2O, SnapKV, as NVIDIA kvpress defines
them), the attention statistics they read, computed with our own forward's per-layer functions
(attention.py), budgets and keep sets (select.py), the policy interface and registry (policy.py:
where a learned policy such as DistillCache plugs in) and the kept cache (cache.py: only the
kept tokens, at their original positions, with the sequence's logical length), the learned policy
(distill.py over features.py: DistillCache, weights beside the pair's artifact) and question-aware
SnapKV (question.py: its keep set serves one question only).

May import torch, transformers' cache, shared.model and shared.kv; never codecs, services or gRPC.
"""

from shared.keep import distill, question  # importing them registers "distill" and "snapkv-q" in POLICIES
from shared.keep.cache import KeptCache, kept_cache, next_positions
from shared.keep.policy import POLICIES, Needs, Policy, Selection, parse_selection
from shared.keep.select import Budget

__all__ = [
    "POLICIES",
    "Budget",
    "KeptCache",
    "Needs",
    "Policy",
    "Selection",
    "distill",
    "kept_cache",
    "next_positions",
    "parse_selection",
    "question",
]
