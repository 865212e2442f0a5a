"""The benches' printed tables: a figure over repeats or seeds as (median, min, max), its
relative spread and its cell, shared by `bench schedules` and the lab's benches."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

Spread = tuple  # (median, min, max), all None when there is nothing


def spread(values: Iterable[float | None]) -> Spread:
    """(median, min, max) of the values that are not None; Nones when there is none."""
    present = [v for v in values if v is not None]
    if not present:
        return (None, None, None)
    return (statistics.median(present), min(present), max(present))


def relative_spread(values: Iterable[float | None]) -> float | None:
    """(max - min) / median of the values that are not None: how far identical runs land
    apart. None with fewer than two values, where the spread is unknown (not zero)."""
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return None
    return (max(present) - min(present)) / statistics.median(present)


def fmt(fig: Spread, spec: str, show_range: bool = True) -> str:
    """A figure's cell: "median [min-max]" (the median alone when min = max or without
    `show_range`), "-" when there is nothing."""
    med, lo, hi = fig
    if med is None:
        return "-"
    if show_range and lo != hi:
        return f"{med:{spec}} [{lo:{spec}}-{hi:{spec}}]"
    return f"{med:{spec}}"


def table_line(cells: list[str], widths: list[int]) -> str:
    """One line of a printed table: the first cell left-aligned, the others right-aligned."""
    return " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=False)))


def name_width(names, floor: int = 11) -> int:
    """The first column's width: `floor`, or the longest name."""
    return max([floor, *(len(n) for n in names)])
