"""Token selection composed with any codec that can take it: a keep transfer sends each layer's
keep set (the payload "keep", shared.codecs.keep_set) and the codec's payloads of the kept tokens
only; the consumer rebuilds the kept tokens at their original positions.

- `KeepRequest`: a keep selection as a request states it (policy, budget, sinks, window, heads),
  checked (`checked`) and resolved for a codec (`for_codec`: heads "each" or "shared").
- `KeptEncoder` (producer) wraps the codec's encoder: it scores each layer with the policy as the
  prefill reaches it (shared.keep: the policy's attention statistics come from the layer's normed
  input, captured for it), then encodes the kept tokens. A layer whose payloads are all one row
  per token (raw K/V, SCD's Reuse codes and Patch inputs, even from a window or a learned
  predictor over earlier tokens) is encoded over the whole context and its kept rows cut out: the
  same rows as the whole transfer's. A layer with a payload grouped along tokens (quantized keys:
  one scale per group of tokens) is encoded over the kept tokens' K/V (its groups are formed
  over the kept tokens, per KV head).
- `KeptDecoder` (consumer) wraps the codec's decoder: it expects "keep" first in every layer
  (checked as it arrives, `check`), gives the codec's decoder the layer's kept positions (RoPE
  of Reuse and Patch layers) and stores n tokens per layer.

A keep transfer is never cut at a chunk boundary (`per_token` False, no token layout): its keep
set depends on the whole context (the producer stores and replays its stream whole, under a key
naming the selection: producer.sources). Knows nothing about gRPC or the services.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from shared.codecs import keep_set
from shared.codecs.base import CacheDecoder, Codec, LayerEncoder, PayloadSpec, Schema, StreamInfo
from shared.errors import DataLoss, InvalidArgument
from shared.keep import POLICIES, Budget, Policy, Selection
from shared.keep.cache import gather
from shared.keep.distill import LEARNED
from shared.keep.policy import layer_view, parse_fields
from shared.kv import Capture, KVSink, LayerState
from shared.models import LoadedModel

HEADS = ("", "each", "shared")
KEEP_OPTION = "keep"  # the consumer's transfer option naming a selection (GenerateRequest.transfer)


# Policies the offline evaluation scores but the services do not serve yet, and why (a request naming
# one is INVALID_ARGUMENT naming keep.policy: KeepRequest.checked and .parse, both sides' way in).
# "distill" is served by a producer holding the pair's keep weights (producer.keep_weights: a
# FailedPrecondition naming keep.policy where it holds none for the request's consumer).
NOT_SERVED = {
    "snapkv-q": "it scores with the question's queries, and the producer is not shown the question",
}


def check_served(policy: str) -> None:
    """InvalidArgument naming keep.policy when the services cannot score with `policy` (NOT_SERVED)."""
    if policy in NOT_SERVED:
        served = sorted(p for p in POLICIES if p not in NOT_SERVED)
        raise InvalidArgument(f"keep.policy: {policy!r} is not served over the wire: {NOT_SERVED[policy]}; served: {served}")


def check_weights(policy: str, weights: str) -> None:
    """InvalidArgument naming keep.weights unless it is "" or a learned policy's 16-hex-digit digest."""
    if not weights:
        return
    if policy not in LEARNED:
        raise InvalidArgument(
            f"keep.weights: {policy!r} is a heuristic: only a learned policy {list(LEARNED)} scores with weights"
        )
    if not re.fullmatch(r"[0-9a-f]{16}", weights):
        raise InvalidArgument(f"keep.weights: {weights[:40]!r} is not a keep weights digest (16 hex digits, lower case)")


@dataclass(frozen=True)
class KeepRequest:
    policy: str
    budget: Budget
    sinks: int = Selection.sinks  # the selection's defaults
    window: int = Selection.window
    heads: str = ""  # "" (the codec's choice), "each" or "shared"
    weights: str = ""  # a learned policy's: the keep weights' digest the caller expects ("" any)

    @staticmethod
    def checked(
        policy: str, fraction: float | None, count: int | None, sinks: int, window: int, heads: str, weights: str = ""
    ) -> KeepRequest:
        """From a request's fields; InvalidArgument naming the field and what is allowed."""
        if policy not in POLICIES:
            raise InvalidArgument(f"keep.policy: {policy[:64]!r} is not one of {sorted(POLICIES)}")
        check_served(policy)
        if heads not in HEADS:
            raise InvalidArgument(f"keep.heads: {heads[:32]!r} is not '', 'each' or 'shared'")
        check_weights(policy, weights)
        try:
            budget = Budget(fraction=fraction, count=count)
        except ValueError as exc:
            raise InvalidArgument(f"keep budget (keep.fraction / keep.count): {exc}") from None
        return KeepRequest(policy, budget, sinks, window, heads, weights)

    @staticmethod
    def parse(text: str) -> KeepRequest:
        """shared.keep.parse_selection's text ('snapkv:0.25', 'h2o:256:window=16,heads=shared'), and
        for a learned policy `weights=DIGEST` among the options; heads "" when the text does not name them."""
        name = text.partition(":")[0]
        check_served(name)
        head, sep, opts = text.rpartition(":") if text.count(":") >= 2 else (text, "", "")
        named = [o for o in opts.split(",") if o.startswith("weights=")]
        rest = ",".join(o for o in opts.split(",") if o and not o.startswith("weights="))
        selection = head + (sep + rest if rest else "")  # without weights=: shared.keep's own text
        try:
            if len(named) > 1:
                raise ValueError("weights=... given twice")
            name, budget, kw = parse_fields(selection)  # not built: a learned one's weights are the producer's
        except ValueError as exc:
            raise InvalidArgument(f"transfer.options['keep']: {text[:80]!r}: {exc}") from None
        weights = named[0].partition("=")[2] if named else ""
        check_weights(name, weights)
        heads = ("shared" if kw["shared"] else "each") if "shared" in kw else ""
        return KeepRequest(name, budget, kw.get("sinks", Selection.sinks), kw.get("window", Selection.window), heads, weights)

    def for_codec(self, codec: Codec) -> KeepRequest:
        """Resolved for `codec` (heads filled in); InvalidArgument when the codec cannot take it."""
        if not codec.keep_heads:
            raise InvalidArgument(
                f"keep: codec '{codec.name}' takes no keep set (its payloads are not one row per kept token);"
                " raw, quant and scd do"
            )
        if codec.keep_heads == "shared" and self.heads == "each":
            raise InvalidArgument(
                f"keep.heads='each': codec '{codec.name}' sends one row per token for all KV heads (Reuse codes,"
                " Patch inputs), so its keep set is shared across a layer's heads: ask heads 'shared' or ''"
            )
        heads = self.heads or ("shared" if codec.keep_heads == "shared" else "each")
        return dataclasses.replace(self, heads=heads)

    @property
    def shared(self) -> bool:
        return self.heads == "shared"

    def selection(self, policy: Policy | None = None) -> Selection:
        """The selection scoring with `policy` (a learned one, the pair's: producer.keep_weights), or
        the registry's policy of that name."""
        if policy is not None and policy.name != self.policy:
            raise ValueError(f"keep: policy {policy.name!r} given for a request naming {self.policy!r}")
        return Selection(policy or POLICIES[self.policy](), self.budget, self.sinks, self.window, self.shared)

    def kept(self, num_tokens: int) -> int:
        return self.budget.kept(num_tokens)

    @property
    def label(self) -> str:
        """Every field, as `parse` reads it back: a key for single flight and stats."""
        weights = f",weights={self.weights}" if self.weights else ""
        return f"{self.policy}:{self.budget}:sinks={self.sinks},window={self.window},heads={self.heads or 'each'}{weights}"


def cut(payload: torch.Tensor, axis: int, keep: torch.Tensor) -> torch.Tensor:
    """The kept rows of a payload with tokens on `axis`: per KV head along axis 1 of a
    [n_kv, T, ...] payload (keep [n_kv, n]), or along axis 0 with one set for all heads."""
    keep = keep.to(payload.device)
    if axis == 0:
        if not bool((keep == keep[:1]).all()):
            raise ValueError("a payload with tokens on axis 0 takes only a keep set shared across KV heads")
        return payload.index_select(0, keep[0])
    if axis != 1 or payload.shape[0] != keep.shape[0]:
        raise ValueError(f"cannot cut a payload of shape {list(payload.shape)} along axis {axis} by keep {list(keep.shape)}")
    index = keep.view(*keep.shape, *[1] * (payload.dim() - 2)).expand(-1, -1, *payload.shape[2:])
    return payload.gather(1, index)


def kept_state(state: LayerState, keep: torch.Tensor, shared: bool) -> LayerState:
    """The layer's state over its kept tokens only (normed: when one set serves every head)."""
    keys, values = state.kv()
    idx = keep.to(keys.device)
    normed = state.normed.index_select(0, idx[0]) if shared and state.normed is not None else None
    return LayerState(state.index, gather(keys, idx), gather(values, idx), normed)


class KeptEncoder(LayerEncoder):
    per_token = False  # never cut in chunks: the keep set depends on the whole context
    computes = True

    def __init__(
        self, inner: LayerEncoder, keep: KeepRequest, loaded: LoadedModel, num_tokens: int, policy: Policy | None = None
    ):
        self.inner, self.keep, self.loaded, self.num_tokens = inner, keep, loaded, num_tokens
        self.selection = keep.selection(policy)  # policy: a learned one's weights for this pair, else the registry's
        policy = self.selection.policy
        self.captures = inner.captures | Capture.KV | (Capture.NORMED if policy.needs else Capture.NONE)

    def metadata(self) -> dict[str, str]:
        return self.inner.metadata()

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        return None  # never cut at a chunk boundary

    def keep_set(self, state: LayerState) -> torch.Tensor:
        """The layer's kept positions [n_kv, n], ascending (the same n for every layer)."""
        policy = self.selection.policy
        view = layer_view(self.loaded, state, policy.needs, policy.observation)
        return self.selection.select([policy.score(view)])[0]

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        keep = self.keep_set(state)
        rows = keep[:1] if self.keep.shared else keep
        payloads = {keep_set.KEEP_PAYLOAD: keep_set.encode(rows, self.num_tokens)}
        layout = self.inner.token_layout(state.index)
        if layout is not None and all(group == 1 for _, group in layout.values()):
            whole = self.inner.encode(state)  # one row per token: the whole transfer's rows, cut
            payloads.update({name: cut(t, layout[name][0], keep) for name, t in whole.items()})
        else:
            payloads.update(self.inner.encode(kept_state(state, keep, self.keep.shared)))
        return payloads


class KeptDecoder(CacheDecoder):
    """The codec's decoder over n = kept_tokens tokens per layer, at the layer's kept positions."""

    def __init__(self, inner: CacheDecoder, stream: StreamInfo, keep: KeepRequest, num_kv_heads: int):
        self.inner, self.stream, self.keep = inner, stream, keep
        self.rows = 1 if keep.shared else num_kv_heads
        dtype, shape = keep_set.wire_shape(stream.num_tokens, stream.kept_tokens, self.rows)
        self.keep_spec = PayloadSpec(dtype, shape)
        self.positions: dict[int, torch.Tensor] = {}  # layer -> [H, n], checked as they arrive

    def expected(self, layer: int) -> Schema:
        return {keep_set.KEEP_PAYLOAD: self.keep_spec, **self.inner.expected(layer)}

    def check(self, layer: int, name: str, payload: torch.Tensor) -> None:
        if name == keep_set.KEEP_PAYLOAD:
            self.positions[layer] = keep_set.decode(payload, self.stream.num_tokens, self.stream.kept_tokens, layer)
        elif layer not in self.positions:  # the contract (producer.proto, LayerChunk): a layer's keep set comes first
            raise DataLoss(
                f"layer {layer}, payload {name!r}: arrived before the layer's {keep_set.KEEP_PAYLOAD!r} payload, which comes first"
            )
        self.inner.check(layer, name, payload)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        positions = self.positions.pop(layer, None)
        if positions is None:  # a caller that did not check as they arrived
            positions = keep_set.decode(payloads[keep_set.KEEP_PAYLOAD], self.stream.num_tokens, self.stream.kept_tokens, layer)
        rest = {k: v for k, v in payloads.items() if k != keep_set.KEEP_PAYLOAD}
        self.inner.at_positions(positions[0])  # RoPE of rebuilt keys (one set per layer where it matters: scd)
        self.inner.add_layer(layer, rest)

    def batch_key(self, layer: int) -> Hashable | None:
        return None  # each keep transfer rebuilds on its own (its positions are its own)

    def bind(self, target: KVSink) -> None:
        self.inner.bind(target)

    def finish(self) -> KVSink:
        return self.inner.finish()
