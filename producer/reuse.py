"""Prefix reuse on the producer: how much of a context the chunk store already holds, what the
forward still computes, how each layer's stream is put together from stored chunks and newly
encoded tokens, and which new chunks to keep.

For a request over T tokens, chunk size C, sending payloads from token F (a multiple of C; 0
unless the consumer already holds the prefix):
- replay: every payload chunk from F on is stored (codec-rooted keys): no forward at all;
- continuation: the forward runs over tokens [P, T) on top of the stored K/V of the first
  P = k·C tokens (model-rooted keys), k the most full chunks whose K/V are stored, whose
  payloads from F on are stored too, and that leave at least one token to compute. Per-token
  encoders (codecs.base.LayerEncoder.per_token) encode the new tokens' states alone; an encoder
  with causal layers (SCD with a learned predictor or a window) encodes those layers over the
  prefix's normalized input, kept with its K/V chunks, joined with the new tokens', and cuts the
  new tokens' payloads out (chunks kept without it do not continue such an encoder);
- K/V-only encoders (`derived`, below) also continue from a stored tail: when the stored chunks
  end in a shorter chunk whose tokens begin the next chunk of this context (the previous turn of
  a conversation), P = k·C + m, m the tail's length cut to a multiple of TAIL_ALIGN and of every
  payload's token group; the chunk it began is kept whole, the tail's tokens joined with the new;
- otherwise the forward runs over the whole context (P = 0).
Each layer sent = stored payload chunks over [F, P) then the new payloads over [max(F, P), T),
joined along each payload's token axis (LayerEncoder.token_layout). The new tokens' full chunks
of K/V and every new chunk of payloads (the tail too: an exact repeat replays it) are kept.

Encoders that read only K/V (raw, quant, SCD schedules of raw/quant layers only) keep no payload
chunks at all: their stored chunks' payloads are encoded again from the stored K/V when sent
(`derived`; raw costs nothing, quant one pass over the chunk), so one K/V chain serves every such
codec and option, and a RAM budget holds twice the context for raw. Their tail K/V is kept too
(an exact repeat replays it).

Memory: a plan holds the stored entries it loaded until it ends; it pins them in the store
(ChunkStore.pin) for that long, so those the store evicts meanwhile are counted
(ChunkStore.pinned_evicted_bytes). `release` ends the pin (the servicer calls it when the
request's stream ends); a plan collected without it releases then.

Knows nothing about gRPC; the engine calls `assemble` on a request's encode lane.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from producer.chunk_store import ChunkEntry, ChunkStore
from shared import chunks
from shared.codecs import LayerEncoder
from shared.codecs.base import chunk_layouts
from shared.kv import Capture, LayerState

Layout = dict[str, tuple[int, int]]
# A continuation from a stored tail starts at a multiple of this many tokens: measured on this
# project's CPU (tiny-llama, float32), a forward continued at a multiple of 16 gave bitwise the
# K/V of a whole prefill at the lengths first measured, at any other offset they differ by ~1.5e-6
# (kernel blocking). Not bitwise at every length (150 -> 230 tokens: ~2e-6): a continuation equals
# a whole prefill within float rounding (docs/design.md, tests/test_prefix_reuse.py).
TAIL_ALIGN = 16


@dataclass(frozen=True)
class Roots:
    """The chains a request's chunks hang from: the producer model's K/V, and this codec's
    payloads under its resolved options and metadata (shared.chunks)."""

    model: str
    codec: str


def _cut(t: torch.Tensor, axis: int, group: int, start: int, end: int, origin: int) -> torch.Tensor:
    """Tokens [start, end) of payload t, which covers tokens from `origin` (start - origin a
    multiple of group)."""
    lo = (start - origin) // group
    hi = -(-(end - origin) // group)
    return t.narrow(axis, lo, hi - lo)


@dataclass
class Continuation:
    """One request's reuse plan (`plan`) and, while its layers are encoded, the chunks to keep."""

    token_ids: list[int]
    chunk_tokens: int
    kv_refs: list[chunks.ChunkRef]
    payload_refs: list[chunks.ChunkRef]
    layouts: list[Layout] | None  # None: payloads do not cut along tokens (sent and kept whole only)
    encoder: LayerEncoder | None = None
    derived: bool = False  # stored payloads are encoded from stored K/V (K/V-only encoders)
    device: torch.device | None = None  # where derived payloads are encoded (the model's; None: CPU)
    send_from: int = 0  # F
    start: int = 0  # P: tokens whose K/V (and payloads from F) come from the store
    replay: bool = False  # every payload chunk from F on is stored: no forward
    keep: bool = True  # keep new chunks (the store has a budget)
    prefix_kv_entries: list[ChunkEntry] = field(default_factory=list)  # chunks [0, P/C)
    payload_entries: list[ChunkEntry] = field(default_factory=list)  # chunks [F/C, P/C), or [F/C, n) on replay
    tail_entry: ChunkEntry | None = None  # a stored shorter chunk the prefix ends with (P not a multiple of C)
    tail_source: ChunkEntry | None = None  # the stored entry tail_entry is cut from (its tensors are views of it)
    release: Callable[[], object] = lambda: None  # ends the plan's pin on the entries it holds (idempotent)
    _new_kv: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # chunk index -> tensors
    _new_payloads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def computed_tokens(self) -> int:
        """Tokens the forward runs over (0 on replay)."""
        return 0 if self.replay else self.num_tokens - self.start

    @property
    def reused_tokens(self) -> int:
        """Tokens whose prefill the store saved."""
        return self.num_tokens - self.computed_tokens

    def prefix_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the stored prefix's (keys, values), [n_kv, P, hd] each (CPU)."""
        if not self.prefix_kv_entries:
            return []
        layers = len({name.split(".")[0] for name in self.prefix_kv_entries[0].tensors})
        return [
            (
                torch.cat([e.tensors[f"{layer}.k"] for e in self.prefix_kv_entries], dim=1),
                torch.cat([e.tensors[f"{layer}.v"] for e in self.prefix_kv_entries], dim=1),
            )
            for layer in range(layers)
        ]

    @property
    def causal(self) -> frozenset[int]:
        return self.encoder.causal_layers if self.encoder is not None else frozenset()

    def encode_new(self, state: LayerState) -> dict[str, torch.Tensor]:
        """On the encode lane: the new tokens' payloads of one layer (tokens [P, T)); a causal
        layer is encoded over the stored prefix's normalized input joined with the new tokens'."""
        assert self.encoder is not None
        if not self.start or state.index not in self.causal:
            return self.encoder.encode(state)
        assert state.normed is not None and self.layouts is not None
        stored = torch.cat([e.tensors[f"{state.index}.normed"] for e in self.prefix_kv_entries])  # [P, d]
        normed = torch.cat([stored.to(state.normed.device, state.normed.dtype), state.normed])  # [T, d]
        wide = LayerState(state.index, keys=state.keys, values=state.values, normed=normed, hidden=state.hidden)
        layout = self.layouts[state.index]
        return {name: _cut(t, *layout[name], self.start, self.num_tokens, 0) for name, t in self.encoder.encode(wide).items()}

    def assemble(self, layer: int, new: dict[str, torch.Tensor], state: LayerState) -> dict[str, torch.Tensor]:
        """On the encode lane: layer `layer`'s payloads to send (tokens [F, T)) from the stored
        chunks and `new` (CPU payloads over tokens [P, T)); records the new chunks to keep."""
        refs, P, F = self.payload_refs, self.start, self.send_from
        first_new = P // self.chunk_tokens
        if self.keep:
            # one device-to-host copy per tensor per layer, chunks cut on the host: a copy per
            # chunk was a synchronizing transfer each (on an H200, 64 per layer at 8192 tokens
            # made most of raw's 462 ms encode_ms in bench/results/gpu.jsonl)
            if self.encoder is not None and not self.encoder.computes:  # raw: `new` is the K/V, on the host already
                keys, values = new["k"], new["v"]
            else:
                keys, values = (t.to("cpu") for t in state.kv())  # [n_kv, T - P, hd]
            normed = state.normed.to("cpu") if layer in self.causal and state.normed is not None else None
            for j in range(first_new, len(self.kv_refs)):
                ref = self.kv_refs[j]
                if ref.end - ref.start < self.chunk_tokens and not self.derived:
                    continue  # a tail's K/V never continues a prefill (only full chunks do); derived: replayed
                kept = self._new_kv.setdefault(j, {})
                lo = max(ref.start - P, 0)
                for name, t in (("k", keys), ("v", values)):
                    new_part = t[:, lo : ref.end - P]
                    if ref.start < P:  # the chunk the stored tail began: its first tokens come from the tail
                        assert self.tail_entry is not None and self.derived
                        kept[f"{layer}.{name}"] = torch.cat([self.tail_entry.tensors[f"{layer}.{name}"], new_part], dim=1)
                    else:
                        kept[f"{layer}.{name}"] = new_part.clone()
                if normed is not None:  # what continues a causal layer
                    kept[f"{layer}.normed"] = normed[ref.start - P : ref.end - P].clone()
        if self.layouts is None:
            return new  # P = F = 0: the whole context, as encoded
        layout = self.layouts[layer]
        if self.keep and not self.derived:
            for j in range(first_new, len(refs)):
                kept = self._new_payloads.setdefault(j, {})
                for name, t in new.items():
                    axis, group = layout[name]
                    kept[f"{layer}.{name}"] = _cut(t, axis, group, refs[j].start, refs[j].end, P).clone()
        stored = self._stored(layer)
        out = {}
        for name, t in new.items():
            axis, group = layout[name]
            tail = _cut(t, axis, group, max(F, P), self.num_tokens, P)
            out[name] = torch.cat([stored[name], tail], dim=axis) if stored else tail
        return out

    def _stored(self, layer: int) -> dict[str, torch.Tensor]:
        """The stored payload chunks' payloads of one layer, joined along tokens ({} when none):
        as kept, or (derived) encoded in one pass from their K/V joined, on the model's device.
        One pass over the joined K/V gives the bytes of one pass per chunk: a per-token encoder's
        groups never straddle a chunk (chunks are cut at multiples of every payload's group)."""
        entries = self.payload_entries
        if not entries:
            return {}
        assert self.layouts is not None
        layout = self.layouts[layer]
        if not self.derived:
            pieces = [e.layer(layer) for e in entries]
            return {name: torch.cat([p[name] for p in pieces], dim=axis) for name, (axis, _) in layout.items()}
        assert self.encoder is not None
        kv = [e.layer(layer) for e in entries]
        keys, values = (torch.cat([x[name] for x in kv], dim=1) for name in ("k", "v"))
        if self.device is not None and self.encoder.computes:  # raw's encode only hands them on
            keys, values = keys.to(self.device), values.to(self.device)
        with torch.inference_mode():  # K/V [n_kv, stored tokens, hd]
            encoded = self.encoder.encode(LayerState(layer, keys=keys, values=values))
            return {name: t.to("cpu").contiguous() for name, t in encoded.items()}

    def replay_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """A replayed layer's payloads over tokens [F, T), joined from the stored chunks."""
        return self._stored(layer)

    def kept(self) -> list[ChunkEntry]:
        """The new chunks to store in chain order, chunk by chunk its K/V then its payloads (a
        continuation needs both: a store that cannot keep them all keeps a usable prefix)."""
        out = []
        for j in sorted(set(self._new_kv) | set(self._new_payloads)):
            if j in self._new_kv:
                r = self.kv_refs[j]
                out.append(ChunkEntry(r.key, r.parent, r.end, self._new_kv[j], r.tokens))
            if j in self._new_payloads:
                r = self.payload_refs[j]
                out.append(ChunkEntry(r.key, r.parent, r.end, self._new_payloads[j], r.tokens))
        return out


def plan(
    store: ChunkStore,
    token_ids: Sequence[int],
    chunk_tokens: int,
    roots: Roots,
    encoder: LayerEncoder,
    num_layers: int,
    send_from: int = 0,
    refs: tuple[list[chunks.ChunkRef], list[chunks.ChunkRef]] | None = None,
    device: torch.device | None = None,
) -> Continuation:
    """What the store already holds for this request (see the module doc). Loads the entries it
    will use (disk reads included: call off the event loop); a chunk that fails to load (a bad
    disk file) shortens the reuse, never serves bad bytes."""
    ids = list(token_ids)
    C, T = chunk_tokens, len(ids)
    kv_refs, payload_refs = refs if refs is not None else (chunks.chain(roots.model, ids, C), chunks.chain(roots.codec, ids, C))
    plan = Continuation(
        ids,
        C,
        kv_refs,
        payload_refs,
        chunk_layouts(encoder, num_layers, C),
        send_from=send_from,
        encoder=encoder,
        keep=store.budget_bytes > 0,
        device=device,
    )
    s = send_from // C
    if plan.layouts is not None and encoder.per_token and encoder.captures == Capture.KV:
        plan.derived, plan.payload_refs = True, plan.kv_refs  # payloads come from stored K/V
    if plan.layouts is not None:
        tail = plan.payload_refs[s:]
        if all(store.has(r.key) for r in tail):
            entries = [store.get(r.key) for r in tail]
            if all(e is not None for e in entries):
                plan.replay, plan.payload_entries, plan.start = True, [e for e in entries if e is not None], T
                return _pinned(store, plan)
    if not (encoder.per_token or (encoder.causal_layers and plan.layouts is not None)):
        return plan
    k = min(chunks.longest(plan.kv_refs, store.has), (T - 1) // C)
    if k > s:
        run = chunks.longest(plan.payload_refs[s:k], store.has) if plan.layouts is not None else 0
        k = s + run
    kv_entries: list[ChunkEntry] = []
    for ref in plan.kv_refs[:k]:
        entry = store.get(ref.key)
        if entry is None or any(f"{layer}.normed" not in entry.tensors for layer in encoder.causal_layers):
            break
        kv_entries.append(entry)
    k = len(kv_entries)
    payload_entries: list[ChunkEntry] = kv_entries[s:k] if plan.derived else []
    for ref in [] if plan.derived else plan.payload_refs[s:k]:
        entry = store.get(ref.key)
        if entry is None:
            break
        payload_entries.append(entry)
    if k > s:
        k = s + len(payload_entries)
    plan.prefix_kv_entries, plan.payload_entries = kv_entries[:k], payload_entries[: max(k - s, 0)]
    plan.start = k * C
    if plan.derived and k >= s and len(plan.prefix_kv_entries) == k:
        last = _stored_tail(store, plan, k)
        if last is not None:  # the stored prefix goes on into a shorter chunk: continue from its end
            plan.prefix_kv_entries.append(last)
            plan.payload_entries.append(last)
            plan.tail_entry, plan.start = last, last.end
    return _pinned(store, plan)


def _pinned(store: ChunkStore, plan: Continuation) -> Continuation:
    """The plan, its stored entries pinned until plan.release() or its collection."""
    held = [e for e in (*plan.prefix_kv_entries, *plan.payload_entries) if e is not plan.tail_entry]
    if plan.tail_source is not None:
        held.append(plan.tail_source)
    if held:
        plan.release = weakref.finalize(plan, store.pin(held))
    return plan


def _stored_tail(store: ChunkStore, plan: Continuation, k: int) -> ChunkEntry | None:
    """The longest stored tail chunk (a context's last, shorter chunk, whose K/V the derived
    encoders keep) that hangs from chunk k - 1 and whose tokens begin chunk k of this context,
    cut to a multiple of TAIL_ALIGN and of every payload's token group, leaving at least one token
    to compute; None when there is none. A tail is found by its key: one hash per candidate length."""
    C, T, ids = plan.chunk_tokens, plan.num_tokens, plan.token_ids
    begin = k * C
    parent = plan.kv_refs[k - 1].key if k else plan.kv_refs[0].parent
    group = math.lcm(TAIL_ALIGN, *(g for layout in plan.layouts or [] for _, g in layout.values()))
    for m in range(min(C - 1, T - 1 - begin), 0, -1):
        key = chunks.chunk_key(parent, ids[begin : begin + m])
        if not store.has(key):
            continue
        entry = store.get(key)
        if entry is None:
            return None
        use = m - m % group
        if use == 0:
            return None
        cut = {name: t[:, :use] for name, t in entry.tensors.items()}  # [n_kv, use, hd]
        plan.tail_source = entry
        return ChunkEntry(chunks.chunk_key(parent, ids[begin : begin + use]), parent, begin + use, cut)  # named for what it holds
    return None
