"""`scd`: Semantic Cache Distillation. Each layer travels as the action its schedule gives it:
Reuse codes (int8, per-token scale) rebuilt through a learned low-rank basis, a Patch (predicted
normalized input, from which the consumer computes K/V with its own weights), raw or quantized
K/V. Schedules and fitted tensors come from a calibrated artifact (shared.scd).

Options: `schedule` (name or text form), or `max_loss` (cheapest schedule whose calibrated loss
is within it) or `max_bytes_per_token` (lowest loss within it); default: the artifact's default
schedule (the one chosen on validation, Artifact.default_entry; the lowest-loss one when none was). `artifact` picks an artifact by id; default: the one calibrated for this pair.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from shared import layers
from shared.codecs.base import (
    CacheDecoder,
    Capture,
    Codec,
    EncodeRequest,
    LayerEncoder,
    LayerJob,
    LayerState,
    Schema,
    StreamInfo,
    register,
)
from shared.codecs.quant import check_payload as check_quant
from shared.codecs.quant import refuse_negative_scales
from shared.codecs.raw import KVDecoder
from shared.errors import DataLoss, FailedPrecondition, InvalidArgument
from shared.scd import ops
from shared.scd.artifact import Artifact, ScheduleEntry, for_pair
from shared.scd.schedule import Schedule


def _optional_float(text: str) -> float | None:
    if text == "":
        return None
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def pick(art: Artifact, options: Mapping[str, str]) -> ScheduleEntry:
    """The schedule `options` (resolved) choose from `art`: both sides compute it, so the consumer
    can require the producer's choice to be exactly this one."""
    return art.pick(
        options.get("schedule", ""),
        _optional_float(options.get("max_loss", "")),
        _optional_float(options.get("max_bytes_per_token", "")),
    )


class ScdEncoder(LayerEncoder):
    def __init__(self, art: Artifact, schedule: Schedule, entry_meta: dict[str, str]):
        self.art, self.schedule, self.entry_meta = art, schedule, entry_meta
        self.captures = (Capture.NORMED if ops.needs_normed(schedule.actions) else Capture.NONE) | (
            Capture.KV if ops.needs_kv(schedule.actions) else Capture.NONE
        )
        # per token unless a Reuse or Patch layer reads earlier tokens (a window, a learned
        # predictor): still causal, so its payloads cut along tokens, and a continued prefill
        # encodes those layers over the prefix's stored normalized input joined with the new
        coded = [i for i, a in enumerate(schedule.actions) if a.kind in ("reuse", "reuse_fp16", "patch")]
        self.causal_layers = frozenset(i for i in coded if art.window > 1 or art.predictor(i) is not None)
        self.per_token = not self.causal_layers

    def encode(self, state: LayerState) -> dict[str, torch.Tensor]:
        return ops.encode_layer(self.art, state.index, self.schedule.actions[state.index], state, self.art.geometry.quant_group)

    def metadata(self) -> dict[str, str]:
        return self.entry_meta

    def token_layout(self, layer: int) -> dict[str, tuple[int, int]] | None:
        return ops.token_layout(self.schedule.actions[layer], self.art.geometry.quant_group)


class ScdDecoder(KVDecoder):
    def __init__(self, codec: ScdCodec, art: Artifact, schedule: Schedule, stream: StreamInfo):
        super().__init__(codec, stream)
        self.art, self.schedule = art, schedule
        self.pos = layers.positions(codec.model, stream.sent_tokens, start=stream.first_token)

    def expected(self, layer: int) -> Schema:
        return ops.layer_schema(
            self.schedule.actions[layer],
            self.loaded,
            self.stream.sent_tokens,
            self.stream.kv_torch_dtype,
            self.art.geometry.quant_group,
        )

    def check(self, layer: int, name: str, payload: torch.Tensor) -> None:
        """Payloads no encoder makes, refused as they complete: int8 codes of -128 (ops.int8_rows
        clamps to -127..127), negative row scales, a quant action's negative scales."""
        if self.schedule.actions[layer].kind == "quant":
            check_quant(layer, name, payload)
        elif payload.dtype == torch.int8 and name in ("z", "x") and bool((payload == -128).any()):
            raise DataLoss(f"layer {layer}: payload '{name}' holds int8 codes of -128 (an encoder's are in -127..127)")
        elif name in ("z_scale", "x_scale"):
            refuse_negative_scales(layer, name, payload)

    def audit_thresholds(self) -> tuple[float, ...] | None:
        return self.art.audit_thresholds(str(self.schedule))

    def richer_options(self) -> dict[str, str] | None:
        """The artifact's lowest-loss schedule, when this stream did not already use it."""
        best = self.art.lowest_loss()
        if best.schedule == str(self.schedule):
            return None
        return {
            **self.stream.options,
            "schedule": best.name,
            "max_loss": "",
            "max_bytes_per_token": "",
            "artifact": self.art.artifact_id,
        }

    def at_positions(self, positions: torch.Tensor) -> None:
        """A keep transfer: the next layer's kept tokens rotate at their original positions."""
        self.pos = positions.to(self.loaded.device)[None]  # [1, n]

    def limits(self, layer: int) -> tuple[float, float]:
        """A Reuse layer is a projection mu + B z, which may gather a token's whole [k | v] norm
        into one element: its limit is shared.kv_bound's `projected`; other actions rebuild K/V
        the consumer's layer could make (or a quantization of them): the layer's own limits."""
        if self.schedule.actions[layer].kind in ("reuse", "reuse_fp16"):
            bound = self.loaded.kv_bounds[layer]
            return bound.projected, bound.projected
        return super().limits(layer)

    def add_layer(self, layer: int, payloads: dict[str, torch.Tensor]) -> None:
        keys, values = ops.decode_layer(
            self.art, layer, self.schedule.actions[layer], payloads, self.loaded, self.pos, self.art.geometry.quant_group
        )
        self.store(layer, keys, values)

    def batch_key(self, layer: int) -> Hashable | None:
        """Requests with the same artifact and action for a layer rebuild it together."""
        return (id(self.art), id(self.loaded), layer, self.schedule.actions[layer])  # the same loaded artifact and model objects

    @classmethod
    def add_layer_batch(cls, jobs: Sequence[LayerJob]) -> list[BaseException | None]:
        """Reuse and Patch layers decode token by token (a row of codes or of normalized input
        gives that token's K/V): one decode over the requests' payloads joined along tokens (each
        at its own positions), split back. Raw and quantized layers decode request by request.
        Either way the K/V are stored together (KVDecoder.store_many: each request's values
        checked on their own)."""
        first: ScdDecoder = jobs[0].decoder  # type: ignore[assignment]
        layer = jobs[0].layer
        action = first.schedule.actions[layer]
        decoders: list[ScdDecoder] = [job.decoder for job in jobs]  # type: ignore[misc]
        if not ops.per_token(action):
            errors: list[BaseException | None] = [None] * len(jobs)
            decoded = []
            for i, job in enumerate(jobs):
                d = decoders[i]
                try:
                    keys, values = ops.decode_layer(
                        d.art, layer, action, job.payloads, d.loaded, d.pos, d.art.geometry.quant_group
                    )
                except Exception as exc:
                    errors[i] = exc
                else:
                    decoded.append((i, keys, values))
            stored = KVDecoder.store_many([(decoders[i], layer, k, v) for i, k, v in decoded])
            for (i, _, _), error in zip(decoded, stored):
                errors[i] = error
            return errors
        payloads = {name: torch.cat([job.payloads[name] for job in jobs]) for name in jobs[0].payloads}
        pos = layers.joined_positions(first.loaded, [d.pos for d in decoders], first.loaded.dtype)  # [1, sum T]
        keys, values = ops.decode_layer(first.art, layer, action, payloads, first.loaded, pos, first.art.geometry.quant_group)
        sizes = [d.pos.shape[1] for d in decoders]
        return KVDecoder.store_many(
            [(d, layer, k, v) for d, k, v in zip(decoders, keys.split(sizes, dim=1), values.split(sizes, dim=1))]
        )


@register
class ScdCodec(Codec):
    name = "scd"
    keep_heads = "shared"  # Reuse codes and Patch inputs: one row per token for all KV heads
    description = "semantic cache distillation: learned low-rank Reuse codes + Patch layers under a loss budget"
    format_version = 2  # 2: Reuse/Patch payloads of predictor layers come from the learned predictor (artifact format 2)
    option_parsers = {
        "schedule": ("", str),
        "max_loss": ("", _optional_float),
        "max_bytes_per_token": ("", _optional_float),
        "artifact": ("", str),
    }

    def __init__(self, model, artifacts=()):
        super().__init__(model, artifacts)
        self.artifacts = [a.to(model.device) for a in artifacts]

    def resolve(self, options: Mapping[str, str]) -> dict[str, str]:
        """Also checks the schedule and budgets against an artifact of this model (either side),
        so a bad rank or an unmeetable budget is INVALID_ARGUMENT before any transfer."""
        resolved = super().resolve(options)
        known = [a.artifact_id for a in self.artifacts]
        if resolved["artifact"] and resolved["artifact"] not in known:
            raise InvalidArgument(f"transfer.options['artifact']: {resolved['artifact']!r} is not loaded here; loaded: {known}")
        digest = self.model.info.weight_digest
        mine = [
            a
            for a in self.artifacts
            if digest in (a.meta["producer"]["weight_digest"], a.meta["consumer"]["weight_digest"])
            and (not resolved["artifact"] or a.artifact_id == resolved["artifact"])
        ]
        if mine:
            pick(mine[0], resolved)
        return resolved

    def _by_id(self, artifact_id: str) -> Artifact:
        for art in self.artifacts:
            if art.artifact_id == artifact_id:
                return art
        raise FailedPrecondition(
            f"SCD artifact {artifact_id!r} named by the producer is not loaded here "
            f"(loaded: {[a.artifact_id for a in self.artifacts]})"
        )

    def encoder(self, options: Mapping[str, str], request: EncodeRequest) -> LayerEncoder:
        if not self.artifacts:
            raise FailedPrecondition("codec 'scd': the producer has no SCD artifact loaded (--artifacts)")
        art = for_pair(self.artifacts, self.model.info.weight_digest, request.consumer_digest, options.get("artifact", ""))
        art.check_model("producer", self.model.info)
        if request.consumer_digest:
            art.check_digest("consumer", request.consumer_digest, "the consumer's, as the request states it")
        entry = pick(art, options)
        schedule = Schedule.parse(entry.schedule, art.num_layers)
        meta = {
            "artifact": art.artifact_id,
            "schedule": entry.schedule,
            "schedule_name": entry.name,
            "calibrated_loss": f"{entry.loss:.6g}",
            "bytes_per_token": f"{entry.bytes_per_token:g}",
        }
        return ScdEncoder(art, schedule, meta)

    def stream_layouts(
        self, options: Mapping[str, str], metadata: Mapping[str, str], request: EncodeRequest
    ) -> list[dict[str, tuple[int, int]] | None]:
        """From the artifact and schedule the header named (as ScdEncoder.token_layout): a consumer
        cannot build this pair's encoder, which needs the producer's weights."""
        art = self._by_id(metadata.get("artifact", ""))
        schedule = Schedule.parse(metadata.get("schedule", ""), art.num_layers)
        return [ops.token_layout(action, art.geometry.quant_group) for action in schedule.actions]

    def decoder(self, stream: StreamInfo) -> CacheDecoder:
        """Accepts only the artifact calibrated for this producer (its header digest) and this
        consumer, and exactly the schedule the request's options choose from it."""
        for key in ("artifact", "schedule"):
            if key not in stream.metadata:
                raise DataLoss(f"scd stream header lacks codec_metadata[{key!r}]")
        asked = stream.options.get("artifact", "")
        if asked and stream.metadata["artifact"] != asked:
            raise DataLoss(f"scd stream header: artifact {stream.metadata['artifact']!r}, the request asked for {asked!r}")
        art = self._by_id(stream.metadata["artifact"])
        art.check_model("consumer", self.model.info)
        art.check_digest("producer", stream.producer_digest, "the producer's, as its stream header states it")
        if art.num_layers != stream.num_layers:
            raise FailedPrecondition(f"artifact has {art.num_layers} layers, stream {stream.num_layers}")
        want = pick(art, stream.options)
        if stream.metadata["schedule"] != want.schedule:
            raise DataLoss(
                f"scd stream header: schedule {stream.metadata['schedule'][:200]!r}, the request's options "
                f"choose {want.schedule!r} from artifact {art.artifact_id}"
            )
        try:
            schedule = Schedule.parse(want.schedule, art.num_layers)
            schedule.check_ranks(art.geometry)
        except InvalidArgument as exc:
            raise DataLoss(f"scd stream header: {exc}") from None
        return ScdDecoder(self, art, schedule, stream)
