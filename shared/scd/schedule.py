"""Layer schedules: one transfer action per decoder layer, their text form and wire cost.

Actions: `R<r>` REUSE at rank r (int8 codes), `F<r>` REUSE at rank r with fp16 codes, `P` PATCH
(fp16 predicted input), `P8` PATCH with int8 codes (one fp16 scale per token), `W` RAW, `Q<b>` QUANT at b bits. A schedule's text
form joins the layer actions with '.', e.g. "R16.R16.P.Q8". Knows nothing about tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.errors import InvalidArgument

_ACTION = re.compile(r"^(R(\d+)|F(\d+)|P(8)?|W|Q(4|8))$")


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "reuse" | "reuse_fp16" | "patch" | "raw" | "quant"
    param: int = 0  # rank for reuse, bits for quant, 8 for an int8 patch (0: fp16)

    def __str__(self) -> str:
        return {
            "reuse": f"R{self.param}",
            "reuse_fp16": f"F{self.param}",
            "patch": "P8" if self.param == 8 else "P",
            "raw": "W",
            "quant": f"Q{self.param}",
        }[self.kind]

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION.match(text)
        if not m:
            raise InvalidArgument(f"schedule: action {text!r} is not one of R<rank>, F<rank>, P, P8, W, Q4, Q8")
        if m.group(2):
            return Action("reuse", int(m.group(2)))
        if m.group(3):
            return Action("reuse_fp16", int(m.group(3)))
        if m.group(5):
            return Action("quant", int(m.group(5)))
        if text.startswith("P"):
            return Action("patch", 8 if m.group(4) else 0)
        return Action("raw")


@dataclass(frozen=True)
class Geometry:
    """What the byte cost of an action depends on."""

    hidden: int  # d, width of the normalized layer input
    kv_width: int  # 2 * n_kv * head_dim, width of [k | v]
    kv_element_bytes: int  # raw K/V element size in the producer dtype
    quant_group: int = 32


def bytes_per_token(action: Action, g: Geometry) -> float:
    """Wire bytes per context token for one layer under `action` (payload only)."""
    if action.kind == "raw":
        return g.kv_width * g.kv_element_bytes
    if action.kind == "reuse":
        return action.param + 2  # int8 codes + one fp16 scale per token
    if action.kind == "reuse_fp16":
        return action.param * 2
    if action.kind == "patch":  # the predicted normalized input: fp16, or int8 + one fp16 scale per token
        return g.hidden + 2 if action.param == 8 else g.hidden * 2
    if action.kind == "quant":
        half = g.kv_width // 2
        codes = g.kv_width * action.param / 8
        # keys: fp16 scale+min per channel per group of tokens; values: per token per group of channels
        scales = 2 * 2 * half / g.quant_group + 2 * 2 * half / g.quant_group
        return codes + scales
    raise ValueError(action)


@dataclass(frozen=True)
class Schedule:
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return ".".join(str(a) for a in self.actions)

    @staticmethod
    def parse(text: str, num_layers: int) -> Schedule:
        if len(text) > 16 * max(num_layers, 1):
            raise InvalidArgument(
                f"schedule: {len(text)} characters, more than {16 * max(num_layers, 1)} for {num_layers} layers"
            )
        parts = text.split(".")
        if len(parts) != num_layers:
            raise InvalidArgument(f"schedule: {len(parts)} actions for {num_layers} layers in {text!r}")
        return Schedule(tuple(Action.parse(p) for p in parts))

    def bytes_per_token(self, g: Geometry) -> float:
        return sum(bytes_per_token(a, g) for a in self.actions)

    def check_ranks(self, g: Geometry) -> None:
        """InvalidArgument unless every Reuse rank is in 1..kv_width (the basis width D)."""
        for layer, a in enumerate(self.actions):
            if a.kind in ("reuse", "reuse_fp16") and not 1 <= a.param <= g.kv_width:
                raise InvalidArgument(f"schedule: layer {layer} action {a} has rank {a.param}, must be in 1..{g.kv_width}")
