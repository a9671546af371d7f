"""Anchor-token repair (ACache's idea, DESIGN §12): after a transfer's rebuild, recompute the K/V of
a few context tokens, the anchors, through the consumer's own layers over the rebuilt prefix, and
write them into the request's blocks before the question is prefilled.

The request asks for it with the transfer option `repair` (`GenerateRequest.transfer.options`):
a fraction of the context's tokens in (0, 1] ("0.1", "1.0") or a count ("64", at most
max_context_tokens; more than the context repairs the whole context). A value of digits alone
is a count: "1" is one token, "1.0" the whole context. `parse_repair` validates it.

Anchor choice (the transfer option `repair_anchors`, beside `repair`):
- `attention` (the default): one probe forward of the question over the rebuilt cache, at its
  positions after the context; per layer, the question's softmax attention (its own queries, the
  cache's keys, every head) is summed over queries and heads, then over layers, per context
  position; the positions with the most mass are the anchors.
- `audit_error`: the audit's per-position error where it is cheap to have at every position,
  layer 1. Layers 0 and 1 of the whole context are computed exact (`run_layers` over the token
  embeddings: 2 of the model's L layers, 2/L of an own prefill) and written into the cache; the
  anchors are the positions whose rebuilt layer-1 K/V were furthest from the exact ones
  (||[k|v]_exact - [k|v]_rebuilt|| / ||[k|v]_exact||, the audit's measure). On a 2-layer model
  that is the whole cache exact: an own prefill's cost, and the anchors change nothing.
- `both`: layers 0 and 1 exact as above, anchors by the sum of the two scores, each normalized to
  sum 1 over the context.

Layer 0 first, whole: its K/V depend on the token ids alone (embedding, norm, projections, RoPE:
no attention), so the consumer writes the exact layer 0 of every context token
(shared.audit.exact_first_layer, as the audit's reference does) before choosing anchors. It costs
about a projection per token, and it matters: an anchor's layer-1 K/V come from its layer-0 hidden
state, which attends to layer 0 of every earlier token; over a rebuilt layer 0 a repaired anchor's
layer 1 was measured further from the exact one than the rebuilt value it replaced (iid noise of
10% on a QA model's cache: 0.095 -> 0.27 relative error), and partial repairs turned oracle-equal
SCD answers into wrong ones. Over an exact layer 0 a 2-layer model's anchors are exact.

Recompute (`recompute`): the audit's machinery (shared.audit): the anchors as one row after the
rebuilt cache, each at its own position, in ONE forward under a 4D mask: anchor i sees the
rebuilt keys of the non-anchor positions before it and the new keys of the anchors up to itself.
The forward goes layer by layer, so at layer l anchor i's K/V come from its layer-(l-1) hidden
state, which attended to the earlier anchors' repaired K/V and to the rebuilt K/V elsewhere:
ACache's approximation, exact only when all tokens are repaired (then the forward is the
consumer's own prefill of the context; tests/test_repair.py checks it against that). Anchors run
in chunks of ANCHOR_CHUNK (a chunk's results go into the base cache before the next one, so the
mask stays [chunk, T + chunk]).

Runs on the engine thread, as one engine job (the engine alone writes blocks): the pipeline
(consumer.pipeline.pipeline) calls `Repairer.apply` after the audit's policy and before verification.
Knows nothing about gRPC, codecs or the prefix cache.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache

from consumer.engine.kv_pool import SequenceKV
from consumer.request.job import GenerateJob, GenerateResult, Repair, left
from shared import audit, kv, layers, logs, probe
from shared.errors import InvalidArgument
from shared.model import of as forward_of
from shared.models import LoadedModel

REPAIR_OPTION = "repair"  # the transfer option's name
ANCHORS_OPTION = "repair_anchors"  # the anchor choice's option (with `repair` only)
ATTENTION, AUDIT_ERROR, BOTH = "attention", "audit_error", "both"  # named in GenerateStats.repair_choice
ANCHOR_CHOICES = (ATTENTION, AUDIT_ERROR, BOTH)
EXACT_LAYERS = 2  # audit_error / both: layers written exact whole (the error is measured at the last of them)
ANCHOR_CHUNK = 256  # anchors per recompute forward
DEFAULT_AUDIT_REPAIR = Repair(fraction=0.1)  # AUDIT_POLICY_REPAIR without the option (bench.serving.verify's curve)

log = logs.get("consumer.exact.repair")


def parse_repair(value: str, max_tokens: int, anchors: str = ATTENTION) -> Repair:
    """The option's value: "0.1" (a fraction of the context in (0, 1]) or "64" (a token count in
    1..max_tokens), and the anchor choice (`repair_anchors`, one of ANCHOR_CHOICES);
    InvalidArgument naming the option and its limits otherwise."""
    if anchors not in ANCHOR_CHOICES:
        raise InvalidArgument(f"transfer.options.{ANCHORS_OPTION}: {anchors[:32]!r} is not one of {list(ANCHOR_CHOICES)}")
    field = f"transfer.options.{REPAIR_OPTION}"
    text = value.strip()
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= max_tokens:
            raise InvalidArgument(f"{field}: {count} tokens not in 1..{max_tokens} (max_context_tokens)")
        return Repair(count=count, anchors=anchors)
    try:
        fraction = float(text)
    except ValueError:
        raise InvalidArgument(
            f"{field}: {value[:32]!r} is neither a fraction of the context in (0, 1] nor a token count in 1..{max_tokens}"
        ) from None
    if not 0 < fraction <= 1:  # NaN fails too
        raise InvalidArgument(f"{field}: fraction {value[:32]!r} not in (0, 1]")
    return Repair(fraction=fraction, anchors=anchors)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # [1, n_kv, L, hd] -> [1, H, L, hd]


@torch.inference_mode()
def attention_mass(loaded: LoadedModel, cache: DynamicCache, context_tokens: int, question_ids: list[int]) -> torch.Tensor:
    """The question's attention mass per context position over the rebuilt `cache` (batch 1, the
    context's T tokens; not modified), summed over layers, heads and question tokens: [T] float32.
    One probe forward of the question after the context (shared.probe); per layer the scores are
    its queries . the keys with the layer's scaling, softmax over the context and the question's
    causal prefix."""
    T, n, device = context_tokens, len(question_ids), loaded.device
    base = [kv.layer_kv(cache, layer) for layer in range(loaded.info.num_layers)]  # [1, n_kv, T, hd]
    mask = torch.zeros((1, 1, n, T + n), dtype=loaded.dtype, device=device)
    mask[0, 0, :, T:] = torch.full((n, n), torch.finfo(loaded.dtype).min, device=device).triu(1).to(loaded.dtype)
    mass = torch.zeros(T, dtype=torch.float32, device=device)
    scaling = loaded.info.head_dim**-0.5

    def look(layer: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        nonlocal mass
        query = q.transpose(0, 1)[None]  # [1, H, n, hd]
        keys = _repeat_kv(keys, query.shape[1] // keys.shape[1])  # [1, H, T + n, hd]
        scores = (query.float() @ keys.float().transpose(-1, -2)) * scaling + mask.float()  # [1, H, n, T + n]
        probs = torch.softmax(scores, dim=-1)
        mass += torch.nan_to_num(probs[0, :, :, :T].sum(dim=(0, 1)))  # a non-finite row adds nothing

    probe.after_cache(loaded, base, question_ids, torch.arange(T, T + n, device=device), mask, look)
    return mass


@torch.inference_mode()
def exact_layers_and_error(loaded: LoadedModel, seq: SequenceKV, context_ids: list[int]) -> torch.Tensor:
    """Write layers 0..EXACT_LAYERS-1 of seq's whole context exact (the consumer's own layers over
    the token embeddings) and return the rebuilt last one's relative error per position, measured
    before it was overwritten: [T] float32 (the audit's measure, shared.audit)."""
    T, device = len(context_ids), loaded.device
    hidden = forward_of(loaded).embedding(torch.tensor(context_ids, device=device))  # [T, d]
    exact = layers.run_layers(loaded, hidden, 0, EXACT_LAYERS)  # [(keys, values)], [n_kv, T, hd] each
    last = EXACT_LAYERS - 1
    keys, values = kv.layer_kv(seq.to_dynamic(T), last)  # [1, n_kv, T, hd]
    rebuilt = torch.cat([keys[0], values[0]], -1).transpose(0, 1)  # [T, n_kv, 2hd]
    error = audit.relative_error(torch.cat(exact[last], -1).transpose(0, 1), rebuilt)
    slots = seq.flat_slots[:T]
    for layer, (k, v) in enumerate(exact):
        seq.pool.write(layer, slots, k.transpose(0, 1), v.transpose(0, 1))  # [T, n_kv, hd]
    return torch.nan_to_num(error, nan=float("inf"))  # a non-finite rebuilt row is the first to repair


def exact_whole(loaded: LoadedModel, anchors_by: str, k: int, context_tokens: int) -> int:
    """How many leading layers a repair writes exact over the whole context: EXACT_LAYERS where the
    anchors are chosen by the rebuilt layer's error among fewer than all tokens, else 1 (layer 0)."""
    chosen_by_error = anchors_by != ATTENTION and k < context_tokens
    return EXACT_LAYERS if chosen_by_error and loaded.info.num_layers >= EXACT_LAYERS else 1


def _share(score: torch.Tensor) -> torch.Tensor:
    finite = torch.nan_to_num(score.float(), posinf=0.0).clamp_min(0)
    total = finite.sum()
    return finite / total if total > 0 else finite


def choose(mass: torch.Tensor, k: int) -> list[int]:
    """The k positions of most mass, ascending (ties: the earlier position)."""
    return sorted(torch.topk(mass, k, sorted=False).indices.tolist()) if k < mass.numel() else list(range(mass.numel()))


@torch.inference_mode()
def recompute(
    loaded: LoadedModel, context_ids: list[int], cache: DynamicCache, anchors: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The anchors' K/V recomputed by the consumer's layers over the rebuilt `cache` (batch 1, the
    context's T tokens; not modified): per layer (keys, values), [n_kv, k, hd] each, post-RoPE, in
    the anchors' (ascending) order. Exact (the own prefill's K/V) when anchors = every position."""
    T, device = len(context_ids), loaded.device
    num_layers = loaded.info.num_layers
    base = [
        (keys.to(loaded.dtype, copy=True), values.to(loaded.dtype, copy=True))
        for keys, values in (kv.layer_kv(cache, layer) for layer in range(num_layers))
    ]  # [1, n_kv, T, hd]
    low = torch.finfo(loaded.dtype).min
    for start in range(0, len(anchors), ANCHOR_CHUNK):
        chunk = anchors[start : start + ANCHOR_CHUNK]
        k = len(chunk)
        where = torch.tensor(chunk, device=device)
        # query i sees the base keys [0, p_i) except this chunk's anchors, and the new keys 0..i
        mask = torch.full((1, 1, k, T + k), low, dtype=loaded.dtype, device=device)
        seen = torch.arange(T, device=device)[None] < where[:, None]  # [k, T]
        seen[:, where] = False
        mask[0, 0, :, :T][seen] = 0
        mask[0, 0, :, T:] = torch.full((k, k), low, device=device).triu(1).to(loaded.dtype)
        new = probe.after_cache(loaded, base, [context_ids[p] for p in chunk], where, mask)  # [n_kv, k, hd] each
        for (keys, values), (new_keys, new_values) in zip(base, new):
            keys[:, :, where] = new_keys[None]
            values[:, :, where] = new_values[None]
    every = torch.tensor(anchors, device=device)
    return [(keys[0][:, every], values[0][:, every]) for keys, values in base]


def repair(
    loaded: LoadedModel, seq: SequenceKV, job: GenerateJob, k: int, anchors_by: str = ATTENTION
) -> tuple[list[int], float]:
    """Write layer 0 of seq's whole context exact (shared.audit.exact_first_layer; layers 0 and 1
    under `audit_error` / `both`), then pick k anchors (`anchors_by`: ANCHOR_CHOICES) and write their
    recomputed K/V of every other layer into seq's blocks (on the engine thread); (anchors, ms)."""
    started = time.perf_counter()
    T = len(job.context_ids)
    if seq.shared_blocks * seq.pool.block_tokens > 0:  # the pipeline never reuses cached blocks under repair
        raise ValueError("repair would write into blocks shared with the prefix cache")
    error = None
    if exact_whole(loaded, anchors_by, k, T) == EXACT_LAYERS:
        error = exact_layers_and_error(loaded, seq, list(job.context_ids))  # layers 0..1 whole, exact
    else:  # layer 0 whole, first: exact from the token ids alone (no attention), the base of the rest
        keys0, values0 = audit.exact_first_layer(loaded, list(job.context_ids))  # [1, n_kv, T, hd]
        seq.pool.write(0, seq.flat_slots[:T], keys0[0].transpose(0, 1), values0[0].transpose(0, 1))
    if k >= T:
        anchors = list(range(T))
    elif error is not None and anchors_by == AUDIT_ERROR:
        anchors = choose(error, k)
    else:
        mass = attention_mass(loaded, seq.to_dynamic(T), T, list(job.question_ids))
        anchors = choose(mass if error is None else _share(mass) + _share(error), k)
    new = recompute(loaded, list(job.context_ids), seq.to_dynamic(T), anchors)
    slots = seq.flat_slots[torch.tensor(anchors, device=seq.table.device)]
    for layer, (keys, values) in enumerate(new):
        seq.pool.write(layer, slots, keys.transpose(0, 1), values.transpose(0, 1))  # [k, n_kv, hd]
    return anchors, (time.perf_counter() - started) * 1e3


class Repairer:
    """The pipeline's repair step: one engine job per request."""

    def __init__(self, loaded: LoadedModel, engine: Any):
        self.loaded, self.engine = loaded, engine

    async def apply(self, job: GenerateJob, result: GenerateResult, seq: SequenceKV, asked: Repair) -> None:
        """Repair seq's rebuilt context (T = len(job.context_ids) tokens) and record it."""
        left(job, "anchor repair")
        T = len(job.context_ids)
        k = asked.tokens(T)
        anchors, ms = await logs.run_in(self.engine, repair, self.loaded, seq, job, k, asked.anchors)
        result.repair_tokens = len(anchors)
        result.repair_ms = ms
        choice = asked.anchors if k < T else "all"
        whole = "layers 0-1" if exact_whole(self.loaded, asked.anchors, k, T) == EXACT_LAYERS else "layer 0"
        result.repair_choice = f"{choice}: {len(anchors)} of {T} context tokens ({asked.label()}); {whole} whole"
