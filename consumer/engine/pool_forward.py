"""The engine's batched forward on our own model (shared.model) with attention over the KV pool in
place: the engine's runner (consumer.engine.hf_reference is the Hugging Face one, the reference
the tests compare with; no serving path runs it).

Rows are flat: every row's new tokens side by side, [N] ids at their own positions, no padding.
Per layer, the new K/V go into the pool by slot mapping (one index_copy_ over all rows' tokens),
then each row attends over its own blocks read where they lie: in the pool's head-major storage
(KVPool.k_heads) a row whose blocks are one ascending run (what the pool hands out when its free
list is not fragmented) is, per head, one contiguous span: a view of the pool, no copy; only a row whose table is not one run has that row's blocks gathered (counted in
`gathered_rows`). Decode rows (one new token) on the CPU go through the paged decode-attention
kernel (consumer.engine.paged_attention), all of them in one call per layer, reading their blocks
through their block tables wherever they lie (`decode_attention="auto"`; "sdpa" keeps them on the
per-row path, for comparison and where the kernel is not built). Other rows (prefill chunks,
verification's k + 1 tokens) of a bfloat16 pool on a CPU with AVX-512 BF16 go through the paged
prefill kernel (consumer.engine.prefill_attention), one call per row and layer, also reading through
the block table (`prefill_attention="auto"`); elsewhere they run SDPA per row with the GQA groups
folded into the query dimension (`_attend_row`): on this CPU that beats SDPA over a gathered
rectangle and compiled FlexAttention over the pool (bench.micro.engine_step's attention rows; bf16
SDPA with enable_gqa is several times slower than the fold). Prefill and decode rows share one
forward; a prefill chunk sees its row's prefix and itself causally (a bottom-right mask).

Same surface as consumer.engine.hf_reference.Runner (`forward(rows)`, Row, the scratch figures: none
here). Knows nothing about scheduling, sampling, codecs or gRPC.
"""

from __future__ import annotations

import sys

import structlog
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from consumer.engine import paged_attention
from consumer.engine.fused_ops import resolve as resolve_fused
from consumer.engine.kv_pool import KVPool
from consumer.engine.prefill_attention import resolve as resolve_prefill
from consumer.engine.rows import Row
from shared import model as own
from shared.models import LoadedModel

log = structlog.get_logger(__name__)


class _RowView:
    """Where one row's keys lie, for the whole forward: when its used blocks are one ascending run,
    views of every layer's K and V over them ([num_layers, 1, n_kv, L, hd], in place); else its
    block table (gathered per layer, after the layer's write). And its bottom-right causal mask
    for n > 1. A row a kernel serves (`by_kernel`: it reads through the block table) gets neither."""

    __slots__ = ("offset", "n", "start", "length", "blocks", "table", "keys", "values", "mask")
    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, row: Row, offset: int, pool: KVPool, groups: int, by_kernel: bool = False):
        Bt, device = pool.block_tokens, pool.device
        self.offset, self.n, self.start = offset, len(row.ids), row.start
        self.length = row.start + self.n  # keys it attends over: its prefix and its new tokens
        used = -(-self.length // Bt)
        self.blocks = row.seq.table[:used]  # its block table (the kernels read through it)
        self.table, self.mask = None, None
        if by_kernel:
            return
        blocks = row.seq.blocks[:used]
        first = blocks[0]
        run = blocks[-1] - first == used - 1 and all(b == first + i for i, b in enumerate(blocks))
        self.table = None if run else self.blocks
        if run:
            L, kv, hd = pool.info.num_layers, pool.info.num_kv_heads, pool.info.head_dim
            span = slice(first, first + used)
            assert pool.k_heads is not None and pool.v_heads is not None
            self.keys = pool.k_heads[:, :, span].view(L, 1, kv, used * Bt, hd)[..., : self.length, :]
            self.values = pool.v_heads[:, :, span].view(L, 1, kv, used * Bt, hd)[..., : self.length, :]
        if self.n > 1 and row.start > 0:  # query j sees keys 0 .. start + j; the fold repeats it per group
            keys = torch.arange(self.length, device=device)
            seen = keys[None] <= row.start + torch.arange(self.n, device=device)[:, None]  # [n, L]
            # additive, in the pool's dtype, built once for every layer: SDPA turns a bool mask into
            # exactly this on each call (a `where` over [g * n, L]: a quarter of a 2048-token prefill)
            mask = torch.zeros(seen.shape, dtype=pool.dtype, device=device).masked_fill_(~seen, float("-inf"))
            self.mask = mask.repeat(groups, 1)[None, None]  # [1, 1, g * n, L]


def _attend_row(view: _RowView, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [n, H, hd] over k/v [1, n_kv, L, hd] -> [n, H, hd]. The query heads of one KV head are
    folded into the query dimension ([1, n_kv, g * n, hd]), so SDPA runs without GQA support
    (the fast kernel; enable_gqa falls off it in bfloat16); a chunk from position 0 runs causal
    over K/V repeated per query head instead."""
    n, H, hd = q.shape
    kv = k.shape[1]
    if n == 1:
        return F.scaled_dot_product_attention(q.view(1, kv, groups, hd), k, v).view(1, H, hd)  # via [1, n_kv, g, hd]
    if view.mask is None:  # a chunk from position 0: plain causal, the kernel skips the masked blocks
        if groups > 1:  # each KV head once per query head (a prefill's copy, small beside its work)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)  # [1, H, n, hd]
        return out[0].transpose(0, 1)
    folded = q.view(n, kv, groups, hd).permute(1, 2, 0, 3).reshape(1, kv, groups * n, hd)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=view.mask)  # [1, n_kv, g * n, hd]
    return out.view(kv, groups, n, hd).permute(2, 0, 1, 3).reshape(n, H, hd)


# auto keeps per-row SDPA for float32 pools with heads this small where the kernel runs its portable
# per-key loop: there its dot products are too short to beat SDPA's float32 path (engine_forward rows at
# 103e3b3, the QA pair, head_dim 32: 0.97-1.13x the per-row step in float32, slower in 5 of 6 cells).
# The vectorized paths (head_dim 32 / 64 / 128, up to 4 query heads per KV head) are faster there too:
# the AVX-512 build's 0.78-0.93x per-row SDPA, the AVX2 build's 0.54-0.9x (QA pair fp32, batch 1-32 at
# 512 tokens, hand runs at 2 threads; the AVX2 one on an AMD EPYC without AVX-512)
AUTO_MIN_FLOAT32_HEAD_DIM = 64


def auto_skips(dtype: torch.dtype, head_dim: int, groups: int = 1) -> str:
    """Why `auto` keeps per-row SDPA for a pool of this dtype, head size and GQA group, or ""."""
    if dtype == torch.float32 and head_dim < AUTO_MIN_FLOAT32_HEAD_DIM:
        if paged_attention.which().startswith(("kernel avx512", "kernel avx2")) and paged_attention.vectorized(head_dim, groups):
            return ""
        return f"auto: float32 with head_dim {head_dim} < {AUTO_MIN_FLOAT32_HEAD_DIM} (per-row SDPA measured faster)"
    return ""


def _decode_kernel(mode: str, device: torch.device, dtype: torch.dtype, head_dim: int, groups: int):
    """(the paged decode-attention kernel for `mode` (paged_attention.MODES) on this device, or None:
    per-row SDPA; why `auto` chose per-row SDPA for this dtype and head size, or "")."""
    if mode not in paged_attention.MODES:
        raise ValueError(f"decode_attention: {mode!r} is not one of {paged_attention.MODES}")
    if mode == "sdpa" or device.type != "cpu":
        if mode == "kernel":
            raise ValueError(f"decode_attention: the kernel runs on the CPU, not on {device}")
        return None, ""
    skip = auto_skips(dtype, head_dim, groups) if mode == "auto" else ""
    if skip:
        return None, skip
    fn = paged_attention.kernel()
    if fn is None and mode == "kernel":
        raise RuntimeError("decode_attention='kernel': the kernel could not be built (see the log)")
    return fn, ""


def _keys(view: _RowView, layer: int, pool_k: torch.Tensor, pool_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's keys and values of one layer, [1, n_kv, L, hd]: in place when its blocks are one
    run, else its blocks gathered (pool_k / pool_v: the layer's [n_kv, NB + 1, Bt, hd])."""
    if view.table is None:
        return view.keys[layer], view.values[layer]
    kv, hd = pool_k.shape[0], pool_k.shape[-1]
    keys = pool_k.index_select(1, view.table).view(1, kv, -1, hd)[:, :, : view.length]
    values = pool_v.index_select(1, view.table).view(1, kv, -1, hd)[:, :, : view.length]
    return keys, values


class _DecodeRows:
    """The forward's decode rows (one new token each) for the paged kernel: their offsets in the flat
    token order `at` [D], block tables padded with the null block `tables` [D, max_blocks] and key
    counts `lengths` [D] (each row's prefix and its new token). Blocks need not be one run."""

    __slots__ = ("count", "at", "tables", "lengths")

    def __init__(self, views: list[_RowView], device: torch.device):
        picked = [view for view in views if view.n == 1]
        self.count = len(picked)
        if not picked:
            return
        # the null block (0) pads: the kernel reads no key past a row's length
        self.tables = pad_sequence([view.blocks for view in picked], batch_first=True)
        self.lengths = torch.tensor([view.length for view in picked], dtype=torch.long, device=device)
        self.at = torch.tensor([view.offset for view in picked], dtype=torch.long, device=device)


class PoolRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        pool: KVPool,
        decode_attention: str = "auto",
        packed: bool = True,
        prefill_attention: str = "auto",
        fused_ops: bool = True,
    ):
        self.loaded, self.pool = loaded, pool
        self.model = own.of(loaded)
        g = self.model.geometry
        if (g.num_kv_heads, g.head_dim, g.num_layers) != (pool.info.num_kv_heads, pool.info.head_dim, pool.info.num_layers):
            raise ValueError(f"{loaded.info.model_id}: the pool's geometry does not match the model's")
        if pool.k_heads is None:
            raise ValueError("pool: the pool forward reads a head-major pool (KVPool(head_major=True))")
        self.groups = g.num_heads // g.num_kv_heads
        self.scratch_limit_blocks = sys.maxsize  # no rectangle is gathered: batches need no split
        self.flat = True  # rows side by side, no padding: any mix of prefill and decode rows is one forward
        self.gathered_rows = 0  # rows whose blocks were not one run (read through a gather)
        # decode rows (one new token) through the paged kernel, all at once per layer; None: per-row SDPA
        # decode_skip: why auto kept per-row SDPA (paged_attention.runs reports it), or ""
        self.decode_kernel, self.decode_skip = _decode_kernel(
            decode_attention, pool.device, pool.dtype, pool.info.head_dim, self.groups
        )
        # rows of more than one new token through the bfloat16 prefill kernel, one call per row and layer;
        # None: per-row SDPA. prefill_runs: what they run ("kernel avx512bf16" or "sdpa: why")
        self.prefill_kernel, self.prefill_runs = resolve_prefill(prefill_attention, pool.device, pool.dtype, pool.info.head_dim)
        # the elementwise steps (norms, residual adds, SiLU * up, RoPE) fused where the extension runs;
        # fused_runs: "fused avx512[ bf16]" or "eager: why"
        self.ops, self.fused_runs = resolve_fused(fused_ops, pool.device, pool.dtype)
        # the projections' weights prepacked for oneDNN (CPU; None elsewhere or with packed=False)
        self.packed = own.Packed.of(self.model) if packed else None
        self.packed_off = "" if self.packed is not None else "packed=False" if not packed else own.Packed.off_reason(self.model)
        if packed and self.packed is None:
            log.info("pool_forward.unpacked", reason=self.packed_off)

    scratch_bytes = 0  # no gather buffers

    def scratch_limit_bytes(self) -> int:
        return 0

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """Append each row's ids to its sequence; the logits of each row's last new token [B, vocab]
        float32, and `row.logits` [tail_logits, vocab] where asked (as Runner.forward). Advances
        every row's `seq.length`."""
        pool, device = self.pool, self.loaded.device
        views, offset = [], 0
        for r in rows:
            by_kernel = (self.decode_kernel if len(r.ids) == 1 else self.prefill_kernel) is not None
            views.append(_RowView(r, offset, pool, self.groups, by_kernel))
            offset += len(r.ids)
        decode = _DecodeRows(views, pool.device) if self.decode_kernel is not None else None
        if decode is not None and decode.count == 0:
            decode = None
        self.gathered_rows += sum(v.table is not None for v in views)  # kernel rows keep none: they read through tables
        ids = torch.tensor([t for r in rows for t in r.ids], dtype=torch.long, device=device)  # [N]
        # [N] RoPE positions: the logical ones (a kept sequence does not store `dropped` tokens)
        pos = torch.tensor([r.start + r.seq.dropped + j for r in rows for j in range(len(r.ids))], device=device)
        slots = torch.cat([r.seq.flat_slots[r.start : r.start + len(r.ids)] for r in rows])  # [N] pool slots
        lengths = [v.n for v in views]
        kv, hd, groups, Bt = pool.info.num_kv_heads, pool.info.head_dim, self.groups, pool.block_tokens
        scale = hd**-0.5  # SDPA's default, which the per-row path uses
        heads_k, heads_v = pool.k_heads, pool.v_heads  # [L, n_kv, NB + 1, Bt, hd]
        assert heads_k is not None and heads_v is not None  # checked at start

        def attend_row(view: _RowView, q_row: torch.Tensor, layer: int, pool_k: torch.Tensor, pool_v: torch.Tensor):
            if self.prefill_kernel is not None and view.n > 1:  # through its block table, no views or gather
                flat_k, flat_v = pool_k.view(kv, -1, hd), pool_v.view(kv, -1, hd)
                return self.prefill_kernel(q_row.contiguous(), flat_k, flat_v, view.blocks, view.start, Bt, scale)
            return _attend_row(view, q_row, *_keys(view, layer, pool_k, pool_v), groups)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool_k, pool_v = heads_k[layer], heads_v[layer]  # [n_kv, NB + 1, Bt, hd]
            pool_k.view(kv, -1, hd).index_copy_(1, slots, k.transpose(0, 1))  # writes by slot mapping
            pool_v.view(kv, -1, hd).index_copy_(1, slots, v.transpose(0, 1))
            if decode is not None:
                flat_k, flat_v = pool_k.view(kv, -1, hd), pool_v.view(kv, -1, hd)
                if decode.count == len(views):  # every row a decode row: one call
                    return self.decode_kernel(q.contiguous(), flat_k, flat_v, decode.tables, decode.lengths, Bt, scale)
                out = torch.empty_like(q)
                found = self.decode_kernel(q.index_select(0, decode.at), flat_k, flat_v, decode.tables, decode.lengths, Bt, scale)
                out.index_copy_(0, decode.at, found)
                for view, q_row in zip(views, q.split(lengths)):
                    if view.n > 1:
                        out[view.offset : view.offset + view.n] = attend_row(view, q_row, layer, pool_k, pool_v)
                return out
            outs = [attend_row(view, q_row, layer, pool_k, pool_v) for view, q_row in zip(views, q.split(lengths))]
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H, hd]

        h = self.model.hidden(ids, pos, attend, self.packed, self.ops)  # [N, d]
        last = torch.tensor([v.offset + v.n - 1 for v in views], device=device)
        logits = self.model.logits(h[last], self.packed, self.ops)  # [B, vocab]
        for view, r in zip(views, rows):
            if r.tail_logits:
                end = view.offset + view.n
                r.logits = self.model.logits(h[end - r.tail_logits : end], self.packed, self.ops)  # [n, vocab]
        for r in rows:
            r.seq.length = r.start + len(r.ids)
        return logits
