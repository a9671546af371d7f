"""The reference runner: one batched forward of the consumer model over the KV pool through Hugging
Face's modules. Not on any serving path: no serving module imports it (tests/test_no_hf_forward.py
checks); the tests compare the engine's own forward (consumer.engine.pool_forward) with it, and
bench.micro.engine_step --compare measures against it. `BatchEngine(runner=Runner)` runs the engine on it.

Each row is a request: new token ids appended at its own positions (`start` = tokens already in
its blocks). Rows have ragged lengths: queries are right-padded to the longest row, keys are the
rows' blocks gathered into a rectangle (padded with the null block), and a boolean mask
[B, 1, n, L] lets query j of row r see keys 0..start_r + j of its own row only. New K/V are
written into the pool in place, for valid tokens only (padding never touches a block). The gather
writes into one pair of scratch buffers the runner keeps and every layer reuses (a layer's gathered
K/V are dead once its attention ran), so a decode step allocates no K/V-sized memory.

Scratch memory is bounded beside the KV budget: a forward gathers at most `scratch_limit_blocks`
blocks (rows x the longest row's blocks; the engine splits a batch that would gather more, see
consumer.engine.batch.split_gather), twice the pool's own block count: K and V of two of the pool's
layers at most, i.e. 2 / num_layers of the KV budget beside it. The buffers grow on demand up to that and shrink back when recent forwards needed less
than a quarter of them (`scratch_bytes` is in Describe and the metrics).

Runs the model's own modules (embedding, rotary embedding, decoder layers, final norm, LM head),
so every number is the model's; the decoder layers receive a cache adapter whose `update` is the
pool write + gather. No module hooks, nothing global: any number of requests share a forward.
Supports decoders without sliding-window layers (Llama, Qwen2, Qwen3). Knows nothing about
scheduling, sampling, codecs or gRPC.
"""

from __future__ import annotations

from typing import Any

import torch

from consumer.engine.kv_pool import NULL_BLOCK, KVPool
from consumer.engine.rows import Row
from shared.models import LoadedModel


class _BatchKV:
    """What the decoder layers see as their cache: write the new tokens, return the batch's K/V."""

    def __init__(self, pool: KVPool, tables: torch.Tensor, write_blk, write_off, row_idx, col_idx, scratch):
        self.pool, self.tables = pool, tables  # tables [B, nblk]
        self.write = (write_blk, write_off, row_idx, col_idx)  # each [N valid tokens]
        self.scratch = scratch  # (k, v) buffers of >= B * nblk blocks the gather writes into

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, kwargs: Any = None):
        """keys/values [B, n_kv, n, hd] (post-RoPE) -> the batch's K/V [B, n_kv, L, hd]."""
        blk, off, rows, cols = self.write
        pool = self.pool
        pool.k[layer_idx, blk, off] = keys[rows, :, cols]  # [N, n_kv, hd]
        pool.v[layer_idx, blk, off] = values[rows, :, cols]
        B, nblk = self.tables.shape
        shape = (B, nblk * pool.block_tokens, pool.info.num_kv_heads, pool.info.head_dim)
        flat = self.tables.view(-1)  # index_select: several times faster than advanced indexing here
        k_out, v_out = (buf[: flat.numel()] for buf in self.scratch)  # reused by every layer: no allocation
        torch.index_select(pool.k[layer_idx], 0, flat, out=k_out)  # gather: [B * nblk, Bt, n_kv, hd]
        torch.index_select(pool.v[layer_idx], 0, flat, out=v_out)
        return k_out.view(shape).transpose(1, 2), v_out.view(shape).transpose(1, 2)  # [B, n_kv, L, hd]


def scratch_limit_blocks(pool: KVPool) -> int:
    """The most blocks one forward gathers (consumer.engine.batch.split_gather keeps batches under it)."""
    return max(1, 2 * pool.num_blocks)


def scratch_limit_bytes(pool: KVPool) -> int:
    """The gather buffers' bound: K and V of two of the pool's layers (2 / num_layers of it)."""
    return scratch_limit_blocks(pool) * pool.block_bytes // max(1, pool.info.num_layers)


class Runner:
    def __init__(self, loaded: LoadedModel, pool: KVPool):
        cfg = loaded.model.config.get_text_config(decoder=True)
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError(f"{loaded.info.model_id}: sliding-window attention is not supported by the batch runner")
        self.loaded, self.pool = loaded, pool
        inner: Any = loaded.model.model
        self.inner = inner
        self.lm_head: Any = loaded.model.get_output_embeddings()
        self._scratch = self._buffers(0)
        self.scratch_limit_blocks = scratch_limit_blocks(pool)  # a forward never gathers more (consumer.engine.batch)
        self.flat = False  # rows padded to the longest: prefill rows packed by length, decode rows apart
        self._recent_peak = 0  # the most blocks a forward needed since the last shrink check
        self._since_check = 0

    def _buffers(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pool
        shape = (blocks, pool.block_tokens, pool.info.num_kv_heads, pool.info.head_dim)
        device = self.loaded.device
        return torch.empty(shape, dtype=pool.dtype, device=device), torch.empty(shape, dtype=pool.dtype, device=device)

    SHRINK_EVERY = 64  # forwards between two checks whether the buffers can shrink

    @property
    def scratch_bytes(self) -> int:
        return self._scratch[0].nbytes + self._scratch[1].nbytes

    def scratch_limit_bytes(self) -> int:
        return scratch_limit_bytes(self.pool)

    def scratch(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather's K and V buffers, at least `blocks` blocks each: one pair for every layer
        (a layer's gathered K/V are dead once its attention ran). Grown by doubling up to
        `scratch_limit_blocks`; every SHRINK_EVERY forwards, cut to twice the recent peak when that
        is under a quarter of their size."""
        if blocks > self.scratch_limit_blocks:
            raise ValueError(f"a forward gathers {blocks} blocks > the scratch limit {self.scratch_limit_blocks}")
        have = self._scratch[0].shape[0]
        self._recent_peak = max(self._recent_peak, blocks)
        self._since_check += 1
        if have < blocks:
            self._scratch = self._buffers(min(max(blocks, 2 * have), self.scratch_limit_blocks))
        elif self._since_check >= self.SHRINK_EVERY:
            if 4 * self._recent_peak < have:
                self._scratch = self._buffers(2 * self._recent_peak)
            self._recent_peak = self._since_check = 0
        return self._scratch

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """Append each row's ids to its sequence; the logits of each row's last new token, [B, vocab]
        float32. A row with `tail_logits` n also gets the logits after each of its last n new
        tokens in `row.logits` [n, vocab] (the norm and LM head over those positions only, so rows
        that ask nothing cost nothing more). Advances every row's `seq.length`."""
        device, Bt = self.loaded.device, self.pool.block_tokens
        B = len(rows)
        n = max(len(r.ids) for r in rows)
        lens = torch.tensor([len(r.ids) for r in rows], device=device)  # [B]
        starts = torch.tensor([r.start for r in rows], device=device)
        ids = torch.tensor([r.ids + [0] * (n - len(r.ids)) for r in rows], dtype=torch.long, device=device)  # [B, n]
        cols = torch.arange(n, device=device)[None]  # [1, n]
        valid = cols < lens[:, None]  # [B, n]
        pos = starts[:, None] + cols  # [B, n]; padded queries get positions past their row's end
        used = [-(-(r.start + len(r.ids)) // Bt) for r in rows]  # blocks each row reads
        nblk = max(used)
        tables = torch.nn.utils.rnn.pad_sequence(  # [B, nblk], padded with the null block
            [r.seq.table[:u] for r, u in zip(rows, used)], batch_first=True, padding_value=NULL_BLOCK
        )
        keys_at = torch.arange(nblk * Bt, device=device)[None, None]  # [1, 1, L]
        mask = keys_at <= pos[:, :, None]  # [B, n, L]: causal within the row's own prefix
        mask = torch.where(valid[:, :, None], mask, keys_at == 0)  # padded queries see one (zero) key
        row_idx, col_idx = valid.nonzero(as_tuple=True)  # [N]
        write_pos = pos[row_idx, col_idx]
        write_blk = tables[row_idx, write_pos // Bt]
        write_off = write_pos % Bt
        cache = _BatchKV(self.pool, tables, write_blk, write_off, row_idx, col_idx, self.scratch(B * nblk))

        h = self.inner.embed_tokens(ids)  # [B, n, d]
        rope_pos = pos + torch.tensor([r.seq.dropped for r in rows], device=device)[:, None]  # logical positions
        emb = self.inner.rotary_emb(h, position_ids=rope_pos)
        attn_mask = mask[:, None]  # [B, 1, n, L]
        for layer in self.inner.layers:
            h = layer(h, attention_mask=attn_mask, position_ids=rope_pos, cache=cache, use_cache=True, position_embeddings=emb)
        last = h[torch.arange(B, device=device), lens - 1]  # [B, d]
        logits = self.lm_head(self.inner.norm(last)).float()  # [B, vocab]
        for i, r in enumerate(rows):
            if r.tail_logits:
                end = len(r.ids)
                r.logits = self.lm_head(self.inner.norm(h[i, end - r.tail_logits : end])).float()  # [n, vocab]
        for r in rows:
            r.seq.length = r.start + len(r.ids)
        return logits
