"""The SCD codec artifact: one safetensors file holding the fitted per-layer tensors, with its JSON
metadata (format version, model ids and weight digests, corpus digest, geometry, the Pareto set
of schedules with measured loss and bytes per token, and the other transfer modes measured on
the same loss scale, "candidates", and codec points sent with a keep set, "keep_points") stored in
the file's header metadata.

Owns saving, loading, discovery, digest checks, schedule choice under budgets and the list of
every transfer mode's (loss, bytes per token) point; not how any of them is measured (calibration).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from shared.errors import FailedPrecondition, InvalidArgument
from shared.models import ModelInfo
from shared.scd.predictor import from_tensors
from shared.scd.schedule import Geometry, Schedule

FORMAT_VERSION = 2  # written; 2 added optional learned predictors (layer.<l>.predictor.*)
READABLE_VERSIONS = (1, 2)  # a version-1 artifact is a version-2 artifact without predictors
KEEP = "keep"  # a keep point's option: its selection (shared.codecs.kept.KEEP_OPTION)
# measured or chosen after fitting: not in the id
MEASURED = ("schedules", "audit", "candidates", "default_schedule", "keep_points")


@dataclass(frozen=True)
class ScheduleEntry:
    name: str
    schedule: str
    loss: float  # calibrated mean KL(oracle || reconstructed), nats per answer token
    bytes_per_token: float


@dataclass(frozen=True)
class TransferPoint:
    """One way to move a context, on the artifact's loss scale: an SCD schedule, another transfer
    mode measured on the same held-out set (meta["candidates"]), a codec point sent with a keep
    set (meta["keep_points"]: options include "keep", the selection's label), or the consumer's
    own prefill."""

    mode: str  # codec name ("scd", "raw", "quant", "recompute"), or "oracle"
    options: tuple[tuple[str, str], ...]  # (option, value) pairs as the codec resolves them, sorted
    loss: float  # mean KL(oracle || this mode), nats per held-out answer token
    bytes_per_token: float  # payload bytes per context token over all layers (oracle: 0, tokens only)
    how: str  # "measured" (on the artifact's held-out set) | "exact" (the oracle, by definition)
    keep_weights: str = ""  # a learned keep point's: the digest of the keep weights it was measured with


@dataclass
class Artifact:
    tensors: dict[str, torch.Tensor]
    meta: dict
    path: Path | None = None
    _predictors: dict = field(default_factory=dict, repr=False, compare=False)

    def to(self, device) -> Artifact:
        """The same artifact with its tensors on `device` (where the model runs)."""
        return Artifact({k: v.to(device) for k, v in self.tensors.items()}, self.meta, self.path)

    @property
    def predictor_layers(self) -> list[int]:
        return sorted(int(l) for l in self.meta.get("predictor", {}).get("layers", {}))

    def predictor(self, layer: int):
        """The layer's learned predictor module (built once, on its tensors' device), or None."""
        config = self.meta.get("predictor", {}).get("config")
        if config is None:
            return None
        if layer not in self._predictors:
            self._predictors[layer] = from_tensors(self.tensors, layer, config)
        return self._predictors[layer]

    @property
    def artifact_id(self) -> str:
        return self.meta["artifact_id"]

    @property
    def window(self) -> int:
        """Tokens of producer state each code is computed from (1: the token itself)."""
        return self.meta.get("calibration", {}).get("window", 1)

    @property
    def num_layers(self) -> int:
        return self.meta["geometry"]["num_layers"]

    @property
    def geometry(self) -> Geometry:
        g = self.meta["geometry"]
        return Geometry(g["hidden"], g["kv_width"], g["kv_element_bytes"], g.get("quant_group", 32))

    @property
    def schedules(self) -> list[ScheduleEntry]:
        return [ScheduleEntry(**s) for s in self.meta.get("schedules", [])]

    def transfer_points(self) -> list[TransferPoint]:
        """Every schedule, every measured candidate, every keep point and the oracle, by increasing
        bytes per token."""
        points = [
            TransferPoint("scd", (("artifact", self.artifact_id), ("schedule", e.name)), e.loss, e.bytes_per_token, "measured")
            for e in self.schedules
        ]
        points += [
            TransferPoint(c["mode"], tuple(sorted(c["options"].items())), c["loss"], c["bytes_per_token"], c["how"])
            for c in self.meta.get("candidates", [])
        ]
        points += [
            TransferPoint(
                c["mode"],
                tuple(sorted({**c["options"], KEEP: c["keep"]}.items())),
                c["loss"],
                c["bytes_per_token"],
                c["how"],
                c.get("keep_weights", ""),
            )
            for c in self.meta.get("keep_points", [])
        ]
        points.append(TransferPoint("oracle", (), 0.0, 0.0, "exact"))
        return sorted(points, key=lambda p: (p.bytes_per_token, p.loss))

    def default_entry(self) -> ScheduleEntry:
        """The artifact's default schedule: the one chosen on validation (meta["default_schedule"],
        written by `set_default`, e.g. bench.serving.quality's headline), else the lowest-loss one."""
        chosen = self.meta.get("default_schedule", {}).get("name")
        for e in self.schedules:
            if e.name == chosen:
                return e
        return self.lowest_loss()

    def default_chosen_on(self) -> str:
        """How the default schedule was chosen, in words."""
        default = self.meta.get("default_schedule")
        if default and any(e.name == default.get("name") for e in self.schedules):
            return str(default.get("chosen_on", ""))
        return "the lowest calibrated loss (no schedule chosen on validation recorded)"

    def lowest_loss(self) -> ScheduleEntry:
        return min(self.schedules, key=lambda e: (e.loss, e.bytes_per_token))

    def set_default(self, name: str, chosen_on: str) -> None:
        """Record the schedule chosen on validation as this artifact's default (its id unchanged;
        `rewrite` writes it back)."""
        if not any(e.name == name or e.schedule == name for e in self.schedules):
            raise ValueError(f"artifact {self.artifact_id}: no schedule {name!r}")
        entry = next(e for e in self.schedules if name in (e.name, e.schedule))
        self.meta["default_schedule"] = {"name": entry.name, "schedule": entry.schedule, "chosen_on": chosen_on}

    def audit_thresholds(self, schedule: str) -> tuple[float, ...] | None:
        """The calibrated per-layer cache-audit thresholds of a schedule (text form), if calibrated."""
        value = self.meta.get("audit", {}).get("thresholds", {}).get(schedule)
        return None if value is None else tuple(float(v) for v in value)

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        return self.tensors[f"layer.{layer}.{name}"]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.meta["format_version"] = FORMAT_VERSION
        self.meta["artifact_id"] = _content_id(self.tensors, self.meta)
        self._write(path)

    def rewrite(self) -> None:
        """Write this loaded artifact back to its file (and .json) with its measurements as they
        are now (MEASURED); the fitted content, hence the id and format version, stay as loaded."""
        if self.path is None:
            raise ValueError("artifact was not loaded from a file")
        now = _content_id(self.tensors, self.meta)
        if now != self.artifact_id:
            raise ValueError(f"artifact {self.artifact_id}: fitted content changed (id now {now}); save it as a new artifact")
        self._write(self.path)

    def _write(self, path: Path) -> None:
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path), metadata={"scd": json.dumps(self.meta)})
        path.with_suffix(".json").write_text(json.dumps(self.meta, indent=2) + "\n")
        self.path = path

    @staticmethod
    def load(path: Path) -> Artifact:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("scd", "{}"))
        version = meta.get("format_version")
        if version not in READABLE_VERSIONS:
            raise FailedPrecondition(f"artifact {path}: format_version {version}, this build reads {list(READABLE_VERSIONS)}")
        return Artifact(owned(load_file(str(path))), meta, path)

    def check_model(self, role: str, info: ModelInfo) -> None:
        """Refuse to serve with weights other than the ones calibrated on (role: producer|consumer)."""
        self.check_digest(role, info.weight_digest, f"loaded {info.model_id}")

    def check_digest(self, role: str, digest: str, what: str) -> None:
        want = self.meta[role]
        if want["weight_digest"] != digest:
            raise FailedPrecondition(
                f"artifact {self.artifact_id}: {role} weight digest {want['weight_digest'][:16]}... ({want['model_id']}) "
                f"!= {digest[:16]}... ({what})"
            )

    def pick(self, schedule: str = "", max_loss: float | None = None, max_bytes: float | None = None) -> ScheduleEntry:
        """A named schedule (or a caller's own schedule text), or the cheapest meeting max_loss, or the
        best loss within max_bytes, or (no budget) the default schedule (`default_entry`)."""
        entries = self.schedules
        if schedule:
            return _within(self._named(schedule), max_loss, max_bytes)
        if max_loss is None and max_bytes is None and entries:
            return self.default_entry()
        fits = [
            e
            for e in entries
            if (max_loss is None or e.loss <= max_loss) and (max_bytes is None or e.bytes_per_token <= max_bytes)
        ]
        if not fits:
            raise InvalidArgument(
                f"transfer.options: no schedule with {_budget_text(max_loss, max_bytes)}; "
                f"available (loss, bytes/token): {[(round(e.loss, 4), e.bytes_per_token) for e in entries]}"
            )
        if max_loss is not None:
            return min(fits, key=lambda e: (e.bytes_per_token, e.loss))
        return min(fits, key=lambda e: (e.loss, e.bytes_per_token))

    def _named(self, schedule: str) -> ScheduleEntry:
        """A schedule of this artifact by name or text, or a caller's own per-layer text (loss not calibrated)."""
        entries = self.schedules
        for e in entries:
            if schedule in (e.name, e.schedule):
                return e
        if "." not in schedule and self.num_layers > 1:
            raise InvalidArgument(
                f"transfer.options['schedule']: {schedule!r} is not a schedule of artifact {self.artifact_id} "
                f"({[e.name for e in entries]}) nor a per-layer schedule text: that needs {self.num_layers} actions "
                f"joined by '.', one per layer (e.g. {'.'.join(['R8'] * self.num_layers)!r})"
            )
        parsed = Schedule.parse(schedule, self.num_layers)
        parsed.check_ranks(self.geometry)
        return ScheduleEntry("custom", str(parsed), float("nan"), parsed.bytes_per_token(self.geometry))


def _budget_text(max_loss: float | None, max_bytes: float | None) -> str:
    parts = ([f"loss <= {max_loss:g}"] if max_loss is not None else []) + (
        [f"bytes_per_token <= {max_bytes:g}"] if max_bytes is not None else []
    )
    return " and ".join(parts)


def _within(entry: ScheduleEntry, max_loss: float | None, max_bytes: float | None) -> ScheduleEntry:
    """A schedule named together with a budget must meet it (a budget is a constraint, never
    ignored); an uncalibrated custom schedule cannot be shown to meet a loss budget."""
    over = []
    if max_loss is not None and not entry.loss <= max_loss:
        loss = "not calibrated (a custom schedule)" if entry.loss != entry.loss else f"{entry.loss:.4g}"
        over.append(f"calibrated loss {loss} > max_loss {max_loss:g}")
    if max_bytes is not None and entry.bytes_per_token > max_bytes:
        over.append(f"{entry.bytes_per_token:g} bytes/token > max_bytes_per_token {max_bytes:g}")
    if over:
        raise InvalidArgument(
            f"transfer.options: schedule {entry.name!r} ({entry.schedule}) does not meet the budget: {'; '.join(over)}"
        )
    return entry


def owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of `tensors` in this process's own memory. safetensors' load_file returns views of
    a private map of the file, whose pages a later in-place write of the file (`cp` over it)
    changes under a running codec: a copy that grew the header shifted every tensor, and layer
    0's basis read the new header's JSON as floats (keys of 2.4e36 in a real.quality run). Owned
    copies keep what was loaded whatever happens to the file afterwards: 46 ms for the real pair's
    84 MB artifact."""
    return {name: t.clone() for name, t in tensors.items()}


def _content_id(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    body = {k: v for k, v in meta.items() if k != "artifact_id" and k not in MEASURED}
    digest.update(json.dumps(body, sort_keys=True).encode())
    return digest.hexdigest()[:16]


# Files beside an artifact that are not artifacts: a learned keep policy's weights
# (<artifact stem>.keep.safetensors, shared.keep.distill.SUFFIX).
SIDECAR_SUFFIXES = (".keep.safetensors",)


def discover(paths: Iterable[str | Path]) -> list[Artifact]:
    """Load every artifact in the given files or directories (*.safetensors, but not the sidecars
    beside them: SIDECAR_SUFFIXES)."""
    found = []
    for p in map(Path, paths):
        files = sorted(f for f in p.glob("*.safetensors") if not f.name.endswith(SIDECAR_SUFFIXES)) if p.is_dir() else [p]
        found += [Artifact.load(f) for f in files]
    return found


def for_pair(artifacts: list[Artifact], producer_digest: str, consumer_digest: str, artifact_id: str = "") -> Artifact:
    """The artifact calibrated for this (producer, consumer) pair, or a precise error."""
    if artifact_id:
        match = [a for a in artifacts if a.artifact_id == artifact_id]
        if not match:
            raise InvalidArgument(
                f"transfer.options['artifact']: {artifact_id!r} not loaded; loaded: {[a.artifact_id for a in artifacts]}"
            )
        return match[0]
    match = [
        a
        for a in artifacts
        if a.meta["producer"]["weight_digest"] == producer_digest
        and (not consumer_digest or a.meta["consumer"]["weight_digest"] == consumer_digest)
    ]
    if not match:
        raise FailedPrecondition(
            f"no SCD artifact for producer digest {producer_digest[:16]}... and consumer digest {consumer_digest[:16] or '(unknown)'}...; "
            f"loaded: {[(a.artifact_id, a.meta['producer']['model_id'], a.meta['consumer']['model_id']) for a in artifacts]}"
        )
    return match[0]
