"""Results and errors of the operator operations (capture, evict, set_budget)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OpOutcome(str, enum.Enum):
    CAPTURED = "captured"
    ALREADY_CAPTURED = "already_captured"
    EVICTED = "evicted"
    NOT_CAPTURED = "not_captured"
    FAILED = "failed"
    OVER_BUDGET = "over_budget"


@dataclass(frozen=True)
class OpResult:
    """Outcome of one operator operation on one bucket, with a human-readable message."""

    outcome: OpOutcome
    message: str = ""
    bytes: int = 0


class GraphsUnavailableError(RuntimeError):
    """Capture/evict was asked for but graphs are off (mode none, or a CPU device)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"CUDA graphs are unavailable: {reason}")
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickles with its reason (it crosses from the engine process)
        return (type(self), (self.reason,))
