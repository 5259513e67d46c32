"""What the serving load reports to a user: per-request TPOT, per-token ITL against the cadence of
paced messages, offered against achieved tokens/s, the spread of repeats and the SLO verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from bench.load_metrics import Slo, cell, message_gaps_ms, spread, summarize, token_gaps_ms, tpot_ms


@dataclass
class Stream:
    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it() -> None:
    assert tpot_ms([(1.0, 1), (1.010, 1), (1.030, 3)]) == pytest.approx(30.0 / 4)
    assert tpot_ms([(1.0, 2), (1.010, 1)]) == pytest.approx(10.0 / 2)  # the first message's second token counts
    assert tpot_ms([(1.0, 1)]) is None and tpot_ms([]) is None


def test_a_message_of_m_tokens_counts_as_m_gaps_and_their_mean_is_the_tpot() -> None:
    messages = [(0.0, 2), (0.010, 1), (0.030, 4)]
    gaps = token_gaps_ms(messages)
    assert gaps == pytest.approx([0.0, 10.0, 5.0, 5.0, 5.0, 5.0])
    assert sum(gaps) / len(gaps) == pytest.approx(tpot_ms(messages))
    assert message_gaps_ms(messages) == pytest.approx([10.0, 20.0])


def paced(sent: float, first_after: float, messages: int, tokens_each: int, every: float) -> Stream:
    """A stream whose tokens come every `every / tokens_each` s, written `tokens_each` at a time."""
    chunks = [(sent + first_after, 1)] + [(sent + first_after + every * (i + 1), tokens_each) for i in range(messages)]
    return Stream(sent, chunks)


def test_paced_messages_show_their_cadence_apart_from_the_time_per_token() -> None:
    # 64 streams, each a message of 8 tokens every 12 ms: 1.5 ms per token, 12 ms between messages
    streams = [paced(i * 0.01, 0.020, 16, 8, 0.012) for i in range(64)]
    row = summarize(streams, offered_tokens=64 * 129, arrival_s=0.63)
    assert row["ok"] == 64 and row["errors"] == 0 and row["tokens"] == 64 * 129
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["ttft_max_ms"] == pytest.approx(20.0)
    assert row["tpot_p50_ms"] == pytest.approx(1.5) and row["tpot_p99_ms"] == pytest.approx(1.5)
    assert row["itl_p99_ms"] == pytest.approx(1.5) and row["itl_max_ms"] == pytest.approx(1.5)
    assert row["msg_gap_p50_ms"] == pytest.approx(12.0) and row["msg_gap_max_ms"] == pytest.approx(12.0)


def test_failed_requests_are_counted_apart_and_left_out_of_the_latencies() -> None:
    streams = [paced(0.0, 0.010, 2, 1, 0.005), Stream(0.1, [(0.5, 1)], error="UNAVAILABLE"), Stream(0.2)]
    row = summarize(streams, offered_tokens=9, arrival_s=0.2)
    assert (row["ok"], row["errors"], row["first_error"]) == (1, 2, "UNAVAILABLE")
    assert row["ttft_max_ms"] == pytest.approx(10.0)


def test_achieved_tokens_per_second_counts_the_settled_part_of_the_arrivals() -> None:
    # arrivals over 10 s; the first fifth is left out: tokens received in [2 s, 10 s)
    streams = [Stream(0.0, [(0.5, 100), (2.5, 300)]), Stream(5.0, [(5.1, 1), (9.9, 99), (11.0, 500)])]
    row = summarize(streams, offered_tokens=1000, arrival_s=10.0)
    assert row["offered_tok_per_s"] == pytest.approx(100.0)
    assert row["achieved_tok_per_s"] == pytest.approx((300 + 1 + 99) / 8.0)


def test_the_spread_of_repeats_is_their_min_median_and_max() -> None:
    repeats = [{"ttft_p99_ms": 40.0, "tpot_p99_ms": None}, {"ttft_p99_ms": 120.0}, {"ttft_p99_ms": 50.0}]
    got = spread(repeats, ["ttft_p99_ms", "tpot_p99_ms", "itl_p99_ms"])
    assert got == {"ttft_p99_ms": {"min": 40.0, "median": 50.0, "max": 120.0}}
    assert cell(got["ttft_p99_ms"]) == "50.0 [40.0-120.0]"
    assert cell({"min": 2.0, "median": 2.0, "max": 2.0}) == "2" and cell(None) == "-"
    assert cell({"min": 18000.0, "median": 21890.0, "max": 22500.0}) == "21,890 [18,000-22,500]"


def test_a_rate_holds_the_slo_only_when_every_repeat_meets_it_without_errors() -> None:
    slo = Slo(ttft_p99_ms=200.0, tpot_p99_ms=10.0)
    good = {"errors": 0, "ttft_p99_ms": 150.0, "tpot_p99_ms": 9.0}
    assert slo.held([good, good, good])
    assert not slo.held([good, {**good, "tpot_p99_ms": 10.5}, good])  # one run in three missed it
    assert not slo.held([good, {**good, "errors": 1}])
    assert not slo.held([{**good, "tpot_p99_ms": None}])  # no measurement is no evidence
    assert not slo.held([])
    assert Slo(ttft_p99_ms=200.0).held([{"errors": 0, "ttft_p99_ms": 199.0}])
    assert "TTFT p99 <= 200 ms and TPOT p99 <= 10 ms" in slo.describe()
    with pytest.raises(ValueError):
        Slo()
