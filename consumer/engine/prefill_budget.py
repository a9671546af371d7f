"""The engine's prefill token budget per iteration, by device: `--prefill-chunk` (tokens one request
prefills per iteration) and `--max-batch-tokens` (prefill tokens per iteration, all requests
together), when the operator leaves them at 0.

A bigger chunk costs fewer iterations per prompt and runs the projections on more rows at once; it
also holds the running streams' next token for its whole forward. On the CPU (the AMX host, the real
pair, the rows at code 4979f9a): 4096 : 4096 against 512 : 2048 gives TTFT at 2k 0.68x
and 1.06x the tokens/s of 32 streams, and the running streams' longest gap while a 2k prompt
arrives 2.4x (400 against 167 ms); a 4k prompt holds them for its whole forward. An operator who
needs short gaps more than TTFT lowers `--prefill-chunk` (512: the old default). The defaults are chosen from
`python -m bench.peer.prefill_budget` rows (bench/results/prefill_budget.jsonl: TTFT at 2k tokens,
32 streams' tokens/s and the longest gap of running streams while a 2k prompt arrives, settings side
by side on one host); docs/results.md "The prefill budget" shows them. CUDA's were not measured (no
device lent when they were chosen): vLLM's OpenAI server defaults for a large GPU stand in.
"""

from __future__ import annotations

# device type -> (prefill_chunk, max_batch_tokens)
DEFAULTS = {
    "cpu": (4096, 4096),  # measured: bench/results/prefill_budget.jsonl (vLLM's own CPU default for its LLM class)
    "cuda": (8192, 8192),  # not measured: vLLM's server default on an H100-class GPU
}
FALLBACK = (512, 2048)  # any other device: the budget this engine had before defaults by device


def resolve(prefill_chunk: int, max_batch_tokens: int, device_type: str) -> tuple[int, int]:
    """(prefill_chunk, max_batch_tokens) with each 0 replaced by the device's default; a chunk larger
    than the iteration's budget is cut to it (one request never takes more than all may)."""
    chunk_default, total_default = DEFAULTS.get(device_type, FALLBACK)
    total = max_batch_tokens or total_default
    chunk = prefill_chunk or min(chunk_default, total)
    return chunk, total
