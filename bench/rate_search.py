"""The highest request rate that holds an SLO, found by bisection between two bounds, not picked.

`holds(rate)` is assumed to fall from True to False once as the rate grows (a server that keeps an
SLO at some rate keeps it at lower ones). The bounds are probed first: a low bound that fails or a
high bound that holds ends the search there and says so. Between them each probe halves the
interval in log space (rates span orders of magnitude) until high / low <= 1 + tolerance. Probes
are expensive (a fresh server per repeat), so each rate is probed once and every probe is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SearchResult:
    held: float | None  # the highest rate probed that held (None: not even the low bound)
    failed: float | None  # the lowest rate probed that failed (None: not even the high bound)
    probes: list[tuple[float, bool]] = field(default_factory=list)  # (rate, held), in the order run

    @property
    def bounded(self) -> bool:
        """Both sides were found: the answer lies in [held, failed)."""
        return self.held is not None and self.failed is not None


def _round(rate: float) -> float:
    """Three significant digits: rates a reader can repeat."""
    return float(f"{rate:.3g}")


def highest_rate(holds: Callable[[float], bool], low: float, high: float, tolerance: float = 0.1) -> SearchResult:
    if not 0 < low < high:
        raise ValueError(f"the search needs 0 < low < high, not {low} and {high}")
    if tolerance <= 0:
        raise ValueError("the tolerance must be positive")
    result = SearchResult(held=None, failed=None)

    def probe(rate: float) -> bool:
        ok = holds(rate)
        result.probes.append((rate, ok))
        return ok

    if not probe(low):
        result.failed = low
        return result
    if probe(high):
        result.held = high
        return result
    while high / low > 1 + tolerance:
        mid = _round(math.sqrt(low * high))
        if not low < mid < high:  # rounding met a bound: the interval is as narrow as it can be said
            break
        if probe(mid):
            low = mid
        else:
            high = mid
    result.held, result.failed = low, high
    return result
