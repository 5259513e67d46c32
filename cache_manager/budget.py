"""Memory budget: parsing, resolution to bytes, size estimates and the eviction policy.

Eviction policy: evict the graph with the lowest *recent replays per byte* first, the least recently
used first among equals. Why: a graph's benefit is the eager time it saves, roughly proportional to
how often it is replayed, and its cost is the memory it pins; replays per byte is the benefit per
unit of the scarce resource, so dropping the lowest ratio frees the most memory for the least lost
speed. "Recent" is an exponentially decayed count (half-life configurable) so a bucket that was hot
an hour ago does not keep its place forever, and a bucket that just became hot is not evicted for a
one-off odd size. Lazy (traffic-driven) captures only displace graphs whose value is at most the
newcomer's (its recent demand per estimated byte); that stops a single unusual batch from evicting a
hot graph and limits thrashing. Operator captures (`GraphCache.capture`) are explicit and may evict
anything except the graphs protected as in use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable
from dataclasses import dataclass

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_budget(value: str) -> int | float:
    """ "2GiB", "512MiB", "1e9" -> bytes (int); "0.2" (a plain number in (0, 1]) -> fraction (float).

    Plain numbers above 1 are bytes and must be whole. Units: B, KB/MB/GB/TB (powers of 1000),
    KiB/MiB/GiB/TiB and K/M/G/T (powers of 1024), case-insensitive.
    """
    m = _BUDGET_RE.match(str(value))
    if not m:
        raise ValueError(
            f"memory budget {value!r}: expected bytes with an optional unit ('2GiB', '512MiB', "
            "'1e9') or a fraction of device memory in (0, 1] ('0.1')"
        )
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit:
        if unit not in _UNITS:
            raise ValueError(
                f"memory budget {value!r}: unknown unit {m.group(2)!r}; use B, KiB, MiB, GiB, ..."
            )
        nbytes = number * _UNITS[unit]
        if nbytes < 1:
            raise ValueError(f"memory budget {value!r} is below one byte")
        return int(nbytes)
    if number <= 0:
        raise ValueError(f"memory budget {value!r} must be > 0 (use mode none to disable graphs)")
    if number <= 1:
        return number
    if number != math.floor(number):
        raise ValueError(f"memory budget {value!r}: a byte count above 1 must be a whole number")
    return int(number)


def resolve_budget(value: str | float | None, total_memory: int, default_fraction: float = 0.1) -> int:
    """Bytes for a budget given as bytes, a fraction of `total_memory`, a string, or None (default)."""
    if value is None:
        value = default_fraction
    if isinstance(value, str):
        value = parse_memory_budget(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"memory budget {value!r} must be a positive byte count or a fraction in (0, 1]")
    if isinstance(value, float) and value <= 1:
        return int(value * total_memory)
    return int(value)


def estimate_bytes(size: int, measured: dict[int, int]) -> int:
    """Guess a graph's bytes before capturing it.

    The same bucket's earlier measurement wins. With one measured bucket, assume the same bytes: the
    fixed part dominates small batches (22 MiB at both batch 1 and 8 on an H200). With two or more,
    interpolate between the nearest measured neighbours, or extrapolate along the nearest two (never
    a negative slope). 0 when nothing was ever measured. An under-estimate never breaks the budget:
    the measurement after capture enforces it; the estimate only avoids wasted captures.
    """
    points = sorted((s, b) for s, b in measured.items() if b > 0)
    known = dict(points)
    if size in known:
        return known[size]
    if len(points) <= 1:
        return points[0][1] if points else 0
    lower = [p for p in points if p[0] < size]
    upper = [p for p in points if p[0] > size]
    if lower and upper:
        (s0, b0), (s1, b1) = lower[-1], upper[0]
    elif lower:
        (s0, b0), (s1, b1) = lower[-2:]
    else:
        (s0, b0), (s1, b1) = upper[:2]
    slope = max(0.0, (b1 - b0) / (s1 - s0))
    anchor_size, anchor_bytes = lower[-1] if lower else upper[0]  # the nearest measured bucket
    return max(0, math.ceil(anchor_bytes + slope * (size - anchor_size)))


@dataclass(frozen=True)
class Candidate:
    """A captured graph that eviction may consider."""

    size: Hashable  # its key (a BatchDescriptor in the cache)
    bytes: int
    heat: float  # decayed recent replays
    last_use: float

    @property
    def score(self) -> float:
        return self.heat / max(self.bytes, 1)


def decay(heat: float, elapsed_s: float, half_life_s: float) -> float:
    if half_life_s <= 0 or elapsed_s <= 0:
        return heat
    return heat * 0.5 ** (elapsed_s / half_life_s)


def choose_victims(
    candidates: list[Candidate], need_bytes: int, max_score: float = math.inf
) -> list[Hashable] | None:
    """Sizes to evict, in policy order, that together free at least `need_bytes`; None if impossible.

    Only candidates with score <= max_score are eligible (see the module docstring). Nothing is
    evicted when the eligible ones cannot free enough: evicting without making room loses speed for
    nothing.
    """
    if need_bytes <= 0:
        return []
    # Equal value: least recently used first, then the larger graph (fewer evictions for the room).
    order = sorted(
        (c for c in candidates if c.score <= max_score), key=lambda c: (c.score, c.last_use, -c.bytes)
    )
    chosen: list[Candidate] = []
    freed = 0
    for c in order:
        chosen.append(c)
        freed += c.bytes
        if freed >= need_bytes:
            break
    else:
        return None
    # Greedy can overshoot (a small cheap graph, then a big one that alone suffices): give back the
    # most valuable victims that are not needed to reach the room.
    for c in sorted(chosen, key=lambda c: (-c.score, -c.last_use)):
        if freed - c.bytes >= need_bytes:
            chosen.remove(c)
            freed -= c.bytes
    return [c.size for c in chosen]
