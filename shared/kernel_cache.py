"""Bounds on oneDNN's caches of compiled kernels (`--onednn-cache-entries`).

On a CPU, torch runs bfloat16 matmuls through oneDNN, which JIT-compiles a kernel for every
distinct problem shape (M x K : K x N) and keeps it in two LRU caches of 1024 entries each by
default: oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's, in front of it
(LRU_CACHE_CAPACITY). An engine forward's M is its padded token count (rows x longest row), which
changes with almost every batch, so under load both caches fill with one entry per shape seen:
~0.26 MiB of kernel each (measured: 137 shapes of the load test, 72 MiB of malloc'd memory held),
up to ~0.5 GiB per cache before their LRU evicts. That was the consumer's RSS growth under mixed
load (issue 43: +65 MB over 40 rounds, still rising).

Bounds, applied once at start-up (both variables are read at the first oneDNN call, so this runs
before the model loads; a variable the operator set already wins and is reported):
- oneDNN's cache holds `entries` kernels (DEFAULT_ENTRIES): a forward's few shapes (per layer
  the same QKV, output, MLP and LM-head shapes, reused by every layer) and those of the batches
  around it stay; a batch of a new size compiles its kernels once more (~1-2 ms each).
- ideep's cache holds 1 (IDEEP_ENTRIES): its entries duplicate oneDNN's; at 1 a lookup that
  misses there hits oneDNN's cache (measured: the same CPU for the load test's matmul sequence).
`entries` -1 leaves both libraries' defaults. Knows nothing about the services.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ONEDNN_VAR, IDEEP_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"
DEFAULT_ENTRIES = 128  # at ~0.26-0.36 MiB a kernel: <= ~46 MiB of kernels (the libraries' defaults: ~0.5 GiB each)
IDEEP_ENTRIES = 1  # ideep's own cache; 0 is not a valid capacity for it (the process aborts)


def bound(entries: int, env: MutableMapping[str, str] | None = None) -> str:
    """Set both caches' capacities in the environment (`env`: os.environ) unless already set; a
    sentence saying what holds, for the start-up log."""
    env = os.environ if env is None else env
    if entries < 0:
        return f"oneDNN's and ideep's defaults (--onednn-cache-entries -1; {ONEDNN_VAR}, {IDEEP_VAR} unset)"
    wanted = {ONEDNN_VAR: str(entries), IDEEP_VAR: str(IDEEP_ENTRIES)}
    kept = {var: env[var] for var in wanted if var in env}
    for var, value in wanted.items():
        env.setdefault(var, value)
    said = f"oneDNN kernel caches: {ONEDNN_VAR}={env[ONEDNN_VAR]}, {IDEEP_VAR}={env[IDEEP_VAR]}"
    return said + (f" (set by the environment: {', '.join(kept)})" if kept else "")
