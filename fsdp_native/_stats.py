"""Introspection: bytes of unsharded parameters, now and at peak, per unit and in total."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from fsdp_native._fully_shard import _units_below


@dataclass(frozen=True)
class UnitStats:
    """Attributes:
    current_bytes: unsharded parameter bytes (plus all-gather buffers in flight) now.
    peak_bytes: the most of those since the last reset.
    unsharded_bytes: the unit's full unsharded parameter size in its compute dtype."""

    current_bytes: int
    peak_bytes: int
    unsharded_bytes: int


@dataclass(frozen=True)
class UnshardedStats:
    """Attributes:
    current_bytes: total over the units under the module now.
    peak_bytes: the peak of that total since the last reset (tracked at every change).
    units: per unit, keyed by the module's qualified name ("" for the root)."""

    current_bytes: int
    peak_bytes: int
    units: dict[str, UnitStats]


def unsharded_stats(module: nn.Module) -> UnshardedStats:
    """Reports the unsharded bytes of every fsdp_native unit under ``module``."""
    units = _units_below(module)
    per = {u.fqn: _module_stats(u.group) for u in units if u.primary is None}
    totals = {id(u.total_acct): u.total_acct for u in units if u.total_acct is not None}
    current = sum(u.acct.current for u in units)
    if len(totals) == 1 and all(u.total_acct is not None for u in units):
        peak = next(iter(totals.values())).peak
    else:
        peak = max(current, max((s.peak_bytes for s in per.values()), default=0))
    return UnshardedStats(current, peak, per)


def _module_stats(group) -> UnitStats:
    """A module's unit, or the sum of its units when its parameters are on several meshes."""
    return UnitStats(
        sum(u.acct.current for u in group),
        sum(u.acct.peak for u in group),
        sum(u.layout.unsharded_numel * u.layout.param_dtype.itemsize for u in group),
    )


def reset_unsharded_peak(module: nn.Module) -> None:
    """Resets the peaks reported by :func:`unsharded_stats` to the current values."""
    for u in _units_below(module):
        u.acct.peak = u.acct.current
        if u.total_acct is not None:
            u.total_acct.peak = u.total_acct.current
