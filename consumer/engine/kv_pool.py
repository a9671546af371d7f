"""The consumer's KV memory: one preallocated pool of fixed-size token blocks per layer, and each
request's view of its blocks (`SequenceKV`).

Layout, per K and per V: `k` / `v` index as [num_layers, num_blocks + 1, block_tokens, n_kv,
head_dim] in the model's dtype on its device, allocated once at start. By default (`head_major`)
that is a view of storage laid out [num_layers, n_kv, num_blocks + 1, block_tokens, head_dim]
(`k_heads` / `v_heads`): one head's keys of a run of consecutive blocks are one contiguous
[tokens, head_dim] span, which attention reads in place (consumer.engine.pool_forward) 1.4-2.3x
as fast as over the token-major layout in float32 on this CPU, 1.1-1.5x in bfloat16
(bench.micro.pool_attention); `head_major=False` keeps the token-major storage. Block 0 is the
null block: always zeros, it pads block tables so a batch gathers a rectangle. A request holds the blocks for its whole
worst case (context + question + max_new_tokens) from admission to release, so a running request
never waits for memory and a batch never preempts; the pool is written in place (rebuilt layers,
prefill and decode tokens), never grown or copied per token.

A released block is zeroed before reuse: a masked-out key or value is still multiplied by zero in
attention, and a stale huge value from a hostile stream would turn that zero into NaN for the next
owner.

Ownership (docs/design.md, "Who owns what"): holders are counted under one lock, so any thread may
allocate free blocks, `hold` blocks it already reaches through a holder and `drop` a hold. A block
whose last holder drops it is not free yet: it waits in a reclaim list until the engine thread
(consumer.engine.batch) zeroes it and puts it back on the free list (`reclaim`, between forwards). So
zeroing and freeing happen on one thread only, never under a forward that may still write the
block, and never on the event loop. Reading and writing blocks is the engine thread's.
Knows nothing about requests, codecs or gRPC.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from shared.models import DTYPES, LoadedModel, ModelInfo

NULL_BLOCK = 0


def bytes_per_token(info: ModelInfo) -> int:
    """K and V of one token over all layers, in the model's dtype."""
    return info.kv_bytes(1)


TYPICAL_REQUEST_TOKENS = 2048  # what the default pool size assumes a request holds


def default_pool_bytes(config, loaded: LoadedModel) -> int:
    """--kv-pool-bytes, or when 0: room for --max-batch requests of 2048 tokens or for two of the
    largest allowed size, whichever is more, capped by half the free GPU memory (after the model)
    or an eighth of the RAM on CPU. Requests beyond it wait for KV memory; it bounds memory, not
    calls."""
    if config.kv_pool_bytes:
        return config.kv_pool_bytes
    largest = config.max_context_tokens + config.max_question_tokens + config.max_new_tokens
    want = max(config.max_batch * TYPICAL_REQUEST_TOKENS, 2 * largest) * bytes_per_token(loaded.info)
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        cap = free // 2
    else:
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    return int(min(want, cap))


class KVPool:
    def __init__(self, info: ModelInfo, device: torch.device, budget_bytes: int, block_tokens: int = 16, head_major: bool = True):
        if block_tokens < 1:
            raise ValueError("block_tokens: must be >= 1")
        self.info, self.device, self.block_tokens = info, device, block_tokens
        self.dtype = DTYPES[info.dtype]
        self.block_bytes = bytes_per_token(info) * block_tokens
        self.num_blocks = max(0, budget_bytes // self.block_bytes)
        L, kv, hd = info.num_layers, info.num_kv_heads, info.head_dim
        if head_major:
            shape = (L, kv, self.num_blocks + 1, block_tokens, hd)
            k, v = (torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2))  # [L, n_kv, NB + 1, Bt, hd]
            self._set(k.permute(0, 2, 3, 1, 4), v.permute(0, 2, 3, 1, 4))
        else:
            shape = (L, self.num_blocks + 1, block_tokens, kv, hd)
            self._set(torch.zeros(shape, dtype=self.dtype, device=device), torch.zeros(shape, dtype=self.dtype, device=device))
        self._free = list(range(self.num_blocks, 0, -1))  # a stack; NULL_BLOCK is never handed out
        self._refs = [0] * (self.num_blocks + 1)  # holders of each block: requests and the prefix cache
        self._dirty: list[int] = []  # held by nobody, not zeroed yet: freed by the engine's reclaim()
        self._lock = threading.Lock()
        self.on_dirty: Callable[[], None] | None = None  # the owner's wake-up: blocks wait for reclaim()
        self.on_freed: list[Callable[[], None]] = []  # called (engine thread) when reclaim() freed blocks

    def _set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [L, NB + 1, Bt, n_kv, hd] (views or not); k_heads/v_heads [L, n_kv, NB + 1, Bt, hd]
        when that is how they lie in memory, else None."""
        self.k, self.v = k, v
        heads = k.permute(0, 3, 1, 2, 4)
        self.k_heads = heads if heads.is_contiguous() else None  # n_kv == 1: either layout
        self.v_heads = v.permute(0, 3, 1, 2, 4) if self.k_heads is not None else None

    def share(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V moved to shared memory (on CPU; CUDA tensors travel by IPC handle as they are),
        for the engine process to attach (consumer.engine.process). Returns them."""
        if self.device.type == "cpu":
            self.k.share_memory_()
            self.v.share_memory_()
        return self.k, self.v

    @classmethod
    def attach(cls, info: ModelInfo, k: torch.Tensor, v: torch.Tensor, block_tokens: int) -> KVPool:
        """A pool over K and V another process allocated (`share`): blocks are read and written by
        block table only; the allocator stays with the owner (this one hands out nothing)."""
        pool = cls(info, k.device, 0, block_tokens)
        pool._set(k, v)
        pool.num_blocks = k.shape[1] - 1  # its size (the runner's scratch bound); none of them free here
        return pool

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def reclaimable_blocks(self) -> int:
        """Blocks nobody holds that wait for the engine to zero and free them."""
        return len(self._dirty)

    @property
    def used_bytes(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    def holders(self, block: int) -> int:
        return self._refs[block]

    def only_holder(self, blocks: list[int]) -> bool:
        """Whether one holder (the caller's) is all `blocks` have: dropping them frees every one."""
        with self._lock:
            return all(self._refs[b] == 1 for b in blocks)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def fits_ever(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_blocks

    def allocate(self, tokens: int, shared: list[int] | None = None) -> SequenceKV | None:
        """Blocks for `tokens` tokens, or None when they are not free now. `shared`: blocks of a
        cached prefix the sequence starts with (read-only for it: it writes only after them),
        already held for it by the caller (`hold`); they count toward `tokens`."""
        shared = list(shared or ())
        need = self.blocks_for(tokens) - len(shared)
        with self._lock:
            if need > len(self._free):
                return None
            own = [self._free.pop() for _ in range(max(0, need))]
            for block in own:
                self._refs[block] += 1
        blocks = shared + own
        table = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return SequenceKV(self, blocks, table, len(blocks) * self.block_tokens, shared_blocks=len(shared))

    def hold(self, blocks: list[int]) -> None:
        """One more holder of `blocks` (the prefix cache keeping a request's chunk)."""
        with self._lock:
            for block in blocks:
                assert self._refs[block] > 0, f"block {block} is not held"
                self._refs[block] += 1

    def drop(self, blocks: list[int]) -> None:
        """One holder fewer (any thread); blocks nobody holds any more wait for `reclaim`."""
        with self._lock:
            dirty = False
            for block in blocks:
                assert self._refs[block] > 0, f"block {block} dropped more often than held"
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._dirty.append(block)
                    dirty = True
        if dirty and self.on_dirty is not None:
            self.on_dirty()

    def reclaim(self) -> int:
        """Zero the blocks nobody holds and put them back on the free list; how many. The owner's
        thread only (the engine, between forwards): a block is zeroed only after every writer let go."""
        with self._lock:
            dirty, self._dirty = self._dirty, []
        if not dirty:
            return 0
        index = torch.tensor(dirty, dtype=torch.long, device=self.device)
        self.k.index_fill_(1, index, 0)  # in place over [layer, block, ...]: no gather-scatter
        self.v.index_fill_(1, index, 0)
        with self._lock:
            self._free.extend(sorted(dirty, reverse=True))  # popped ascending: a run again (read in place)
        for wake in self.on_freed:
            wake()
        return len(dirty)

    def zero_after(self, block: int, offset: int) -> None:
        """Zero token slots offset.. of one block (every layer): the part of a cached tail's last
        block that held the inserting request's question and answer. Engine thread."""
        if offset < self.block_tokens:
            self.k[:, block, offset:] = 0
            self.v[:, block, offset:] = 0

    def copy_blocks(self, source: list[int], target: list[int]) -> None:
        """Copy blocks' K/V (every layer) into others, pairwise (a cached tail into a request's own
        blocks). Engine thread."""
        n = min(len(source), len(target))
        if n:
            src = torch.tensor(source[:n], dtype=torch.long, device=self.device)
            dst = torch.tensor(target[:n], dtype=torch.long, device=self.device)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def release(self, seq: SequenceKV) -> None:
        """The sequence lets go of its blocks (freed by the next `reclaim` unless the prefix cache
        still holds them); a second release is a no-op."""
        self.release_many([seq])

    def release_many(self, seqs: list[SequenceKV]) -> None:
        """release() of several sequences (their freed blocks zeroed together by one reclaim)."""
        blocks = []
        for seq in seqs:
            if not seq.released:
                seq.released = True
                blocks += seq.blocks
        self.drop(blocks)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [N, n_kv, hd] into the flat token slots `slots` [N] (block * block_tokens +
        offset, `SequenceKV.flat_slots`) of one layer: one index_copy_ each, however many requests'
        tokens the slots cover."""
        kv, hd = self.info.num_kv_heads, self.info.head_dim
        if self.k_heads is not None and self.v_heads is not None:  # [n_kv, slots, hd] per layer
            self.k_heads[layer].view(kv, -1, hd).index_copy_(1, slots, keys.to(self.dtype).transpose(0, 1))
            self.v_heads[layer].view(kv, -1, hd).index_copy_(1, slots, values.to(self.dtype).transpose(0, 1))
            return
        self.k[layer].view(-1, kv, hd).index_copy_(0, slots, keys.to(self.dtype))
        self.v[layer].view(-1, kv, hd).index_copy_(0, slots, values.to(self.dtype))

    def slots(self, positions: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) index tensors of token positions under a block table."""
        return table[positions // self.block_tokens], positions % self.block_tokens


@dataclass(eq=False)
class SequenceKV:
    """One request's blocks. `length` tokens are valid (positions 0..length-1, every layer)."""

    pool: KVPool
    blocks: list[int]
    table: torch.Tensor  # [num_blocks] long, on the pool's device
    capacity: int  # tokens the blocks hold
    length: int = 0
    released: bool = False
    shared_blocks: int = 0  # leading blocks shared with the prefix cache: never written by this request

    first_write: int = 0  # where a codec decoder's layers start (tokens before it are a cached prefix)
    # context tokens of the logical sequence that are not stored (a kept transfer, shared.keep): the
    # stored tokens keep their own RoPE, and a token at storage index i runs at position i + dropped
    dropped: int = 0

    @functools.cached_property
    def flat_slots(self) -> torch.Tensor:
        """The flat pool slot (block * block_tokens + offset) of each of its `capacity` token
        positions, [capacity] long: its blocks never change, so computed once."""
        Bt = self.pool.block_tokens
        return (self.table[:, None] * Bt + torch.arange(Bt, device=self.table.device)).reshape(-1)

    def split_off(self, blocks: int) -> SequenceKV:
        """Its last `blocks` blocks as a sequence of their own, before anything was written: one
        admission reserves both caches of verified decoding (consumer.exact.verify) at once, so a
        request never holds one while it waits for the other. Each is released on its own."""
        if not 0 < blocks <= len(self.blocks) - self.shared_blocks or self.length or "flat_slots" in self.__dict__:
            raise ValueError(f"cannot split {blocks} blocks off a sequence of {len(self.blocks)} (used or shared)")
        keep = len(self.blocks) - blocks
        tail = SequenceKV(self.pool, self.blocks[keep:], self.table[keep:], blocks * self.pool.block_tokens)
        self.blocks, self.table = self.blocks[:keep], self.table[:keep]
        self.capacity = keep * self.pool.block_tokens
        return tail

    def _span(self, layer: int, tokens: int) -> slice:
        """Positions a codec decoder's layer write of `tokens` tokens covers: first_write .. ;
        ValueError when they exceed the reservation or fall inside the shared prefix."""
        start = self.first_write
        end = start + tokens
        if end > self.capacity:
            raise ValueError(f"layer {layer}: {end} tokens > the {self.capacity} this request reserved")
        if start < self.shared_blocks * self.pool.block_tokens:
            raise ValueError(f"layer {layer}: write at {start} inside the shared prefix")
        return slice(start, end)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, kwargs=None) -> None:
        """A codec decoder's write of one whole layer over the context (the DynamicCache surface
        shared.kv.put_layer uses): keys/values [1, n_kv, n, hd], post-RoPE, at positions
        first_write .. first_write + n - 1."""
        error = SequenceKV.update_many([(self, layer, keys, values)])[0]
        if error is not None:
            raise error

    @staticmethod
    def update_many(items: list[tuple[SequenceKV, int, torch.Tensor, torch.Tensor]]) -> list[BaseException | None]:
        """update() of several sequences (seq, layer, keys, values), each [1, n_kv, n, hd]: the
        writes to one pool layer in one copy. Per item, the ValueError its own bounds raised, or
        None; an item that fails writes nothing."""
        errors: list[BaseException | None] = [None] * len(items)
        groups: dict[tuple[KVPool, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for i, (seq, layer, keys, values) in enumerate(items):
            try:
                span = seq._span(layer, keys.shape[2])
            except ValueError as exc:
                errors[i] = exc
                continue
            groups.setdefault((seq.pool, layer), []).append(
                (seq.flat_slots[span], keys[0].transpose(0, 1), values[0].transpose(0, 1))
            )
        for (pool, layer), writes in groups.items():
            if len(writes) == 1:
                slots, keys, values = writes[0]
            else:
                slots, keys, values = (torch.cat(parts) for parts in zip(*writes))
            pool.write(layer, slots, keys, values)
        return errors

    def to_dynamic(self, tokens: int | None = None) -> DynamicCache:
        """A copy of the first `tokens` (default: length) positions as a DynamicCache (batch 1):
        for the cache audit, which runs its own probe forward on top."""
        T = self.length if tokens is None else tokens
        blk, off = self.pool.slots(torch.arange(T, device=self.pool.device), self.table)
        cache = DynamicCache()
        for layer in range(self.pool.info.num_layers):
            keys = self.pool.k[layer, blk, off].transpose(0, 1)[None]  # [1, n_kv, T, hd]
            values = self.pool.v[layer, blk, off].transpose(0, 1)[None]
            cache.update(keys, values, layer)
        return cache
