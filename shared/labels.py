"""The one text form of a transfer mode and its options, used in stats, logs, the planner's keys
and every benchmark table (no torch: benchmark reports import it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def options_label(options: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """'bits=8,group_size=32' (sorted by name); "" for none."""
    items = options.items() if isinstance(options, Mapping) else options
    return ",".join(f"{k}={v}" for k, v in sorted(items))


def mode_label(mode: str, label: str) -> str:
    """'quant(bits=8)', 'scd(R2.R64)', or 'raw' when there is nothing to show."""
    return f"{mode}({label})" if label else mode
