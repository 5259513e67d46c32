"""Test-only fault injection, off unless GRAPHSERVE_TEST_FAULTS is set.

The robustness tests use it to prove what a real fault would do: e.g.
GRAPHSERVE_TEST_FAULTS="load_delay_s=2,decode_raise_after=5" delays model loading by 2 s and makes
the 6th decode step raise. Production never sets it; the start-up log shows it when set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENV = "GRAPHSERVE_TEST_FAULTS"


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Faults:
    load_delay_s: float = 0.0
    decode_raise_after: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Faults:
        text = environ.get(ENV, "").strip()
        if not text:
            return cls()
        values: dict[str, float | int] = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key == "load_delay_s":
                values[key] = float(value)
            elif key == "decode_raise_after":
                values[key] = int(value)
            else:
                raise ValueError(f"{ENV}: unknown fault {key!r}")
        return cls(**values)

    @property
    def active(self) -> bool:
        return self != Faults()


def wrap_decode(runner: object, raise_after: int) -> None:
    """Make the runner's decode-only steps (`mixed` with no prompt chunk) raise InjectedFault once
    `raise_after` of them have run."""
    real = runner.mixed  # type: ignore[attr-defined]
    calls = 0

    def mixed(decodes, chunks):  # noqa: ANN001, ANN202
        nonlocal calls
        if not chunks:
            calls += 1
            if calls > raise_after:
                raise InjectedFault(f"injected decode failure at step {calls}")
        return real(decodes, chunks)

    runner.mixed = mixed  # type: ignore[attr-defined]
