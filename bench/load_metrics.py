"""The serving load's numbers, from the client's receive times of each stream's messages.

Per request: TTFT (send to first token) and TPOT ((last token's time - first token's time) /
(tokens - 1)). Per token: ITL, where a message of m tokens arriving `gap` after the one before
counts as m gaps of gap / m (the tokens of the first message after the first token count as gaps of
0), so a request's mean per-token ITL is its TPOT. Per message: the cadence of the server's writes
(one gap per message, whatever it carries): with paced writes (`--stream-message-rate`) a stream gets
a message every few milliseconds however fast tokens are made, so cadence is not per-token latency.
Each is reported as p50 / p99 / max over the run. Repeats of a run are summed up by their spread
(min / median / max of each figure), and an SLO holds at a rate only when every repeat meets it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.common import percentile

Messages = Sequence[tuple[float, int]]  # (receive time in seconds, tokens in the message)
# The figures a repeat's spread is taken of, and what a table shows.
SPREAD_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
               "msg_gap_p50_ms", "msg_gap_p99_ms", "offered_tok_per_s", "achieved_tok_per_s", "running_peak")
SETTLE_FRACTION = 0.2  # the first part of the arrivals, while the server fills up, is left out of achieved tokens/s


class Stream(Protocol):
    sent: float
    chunks: list[tuple[float, int]]
    error: str | None


def tpot_ms(messages: Messages) -> float | None:
    """(last token - first token) / (tokens - 1); None for fewer than two tokens."""
    tokens = sum(k for _, k in messages)
    if tokens < 2:
        return None
    return (messages[-1][0] - messages[0][0]) * 1000.0 / (tokens - 1)


def token_gaps_ms(messages: Messages) -> list[float]:
    """One gap per token after the first: each message's interval spread evenly over its tokens."""
    if not messages:
        return []
    gaps = [0.0] * (messages[0][1] - 1)
    for (before, _), (at, k) in zip(messages, messages[1:]):
        gaps += [(at - before) * 1000.0 / k] * k
    return gaps


def message_gaps_ms(messages: Messages) -> list[float]:
    """One gap per message after the first: the cadence a stream's writes keep."""
    return [(at - before) * 1000.0 for (before, _), (at, _) in zip(messages, messages[1:])]


def distribution(name: str, values: list[float]) -> dict[str, float | None]:
    return {f"{name}_p50_ms": percentile(values, 50), f"{name}_p99_ms": percentile(values, 99),
            f"{name}_max_ms": max(values, default=None)}


def tokens_in(streams: Iterable[Stream], start: float, stop: float) -> int:
    return sum(k for s in streams for at, k in s.chunks if start <= at < stop)


def summarize(streams: Sequence[Stream], offered_tokens: int, arrival_s: float) -> dict[str, Any]:
    """TTFT, TPOT, per-token ITL and message cadence of the streams that finished without error;
    offered tokens/s (the output tokens asked for over the arrivals' span) against achieved (tokens
    received over that span, its first SETTLE_FRACTION left out)."""
    ok = [s for s in streams if s.error is None and s.chunks]
    start = min((s.sent for s in streams), default=0.0)
    settled = start + SETTLE_FRACTION * arrival_s
    window = arrival_s - (settled - start)
    return {
        "ok": len(ok), "errors": len(streams) - len(ok),
        "first_error": next((s.error for s in streams if s.error), None),
        "tokens": sum(k for s in ok for _, k in s.chunks),
        **distribution("ttft", [(s.chunks[0][0] - s.sent) * 1000.0 for s in ok]),
        **distribution("tpot", [t for s in ok if (t := tpot_ms(s.chunks)) is not None]),
        **distribution("itl", [g for s in ok for g in token_gaps_ms(s.chunks)]),
        **distribution("msg_gap", [g for s in ok for g in message_gaps_ms(s.chunks)]),
        "offered_tok_per_s": offered_tokens / arrival_s if arrival_s > 0 else None,
        "achieved_tok_per_s": tokens_in(ok, settled, start + arrival_s) / window if window > 0 else None,
    }


def spread(rows: Sequence[dict[str, Any]], keys: Iterable[str] = SPREAD_KEYS) -> dict[str, dict[str, float]]:
    """min / median / max of each key over the repeats that have it."""
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


@dataclass(frozen=True)
class Slo:
    """Limits a rate must keep: TTFT p99 and TPOT p99 in ms (None: not limited)."""

    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_p99_ms is None and self.tpot_p99_ms is None:
            raise ValueError("an SLO needs a TTFT p99 or a TPOT p99 limit")

    def met_by(self, row: dict[str, Any]) -> bool:
        """One run: no request failed and each limit held."""
        limits = {"ttft_p99_ms": self.ttft_p99_ms, "tpot_p99_ms": self.tpot_p99_ms}
        return row.get("errors", 0) == 0 and all(
            row.get(key) is not None and row[key] <= limit for key, limit in limits.items() if limit is not None)

    def held(self, repeats: Sequence[dict[str, Any]]) -> bool:
        """A rate holds the SLO when every repeat meets it: one run in three missing it is what users meet."""
        return bool(repeats) and all(self.met_by(r) for r in repeats)

    def describe(self) -> str:
        parts = [f"TTFT p99 <= {self.ttft_p99_ms:g} ms" if self.ttft_p99_ms is not None else "",
                 f"TPOT p99 <= {self.tpot_p99_ms:g} ms" if self.tpot_p99_ms is not None else ""]
        return " and ".join(p for p in parts if p) + ", every repeat, no errors"


def cell(spread_of: dict[str, float] | None) -> str:
    """"median [min-max]" for a table; "-" without data."""
    if not spread_of:
        return "-"

    def fmt(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if spread_of["min"] == spread_of["max"]:
        return fmt(spread_of["median"])
    return f"{fmt(spread_of['median'])} [{fmt(spread_of['min'])}-{fmt(spread_of['max'])}]"
