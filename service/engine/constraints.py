"""A process's structured-output machinery, made once at start: the grammar compiler (the
tokenizer's vocabulary prepared: about a second for 128k tokens, most of it holding the GIL, so
never while serving), the workers that prepare each request's constraint (constraint_prepare.py)
and those that fill each step's masks (mask_fill.py), under the budgets of ConstraintLimits.

Only the engine's process has one: the gRPC process checks sizes (constraint_limits.check_size)
and nothing else, so no constraint can cost it memory or a thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

from service.engine.constraint_limits import ConstraintLimits
from service.engine.constraint_prepare import ConstraintPreparer
from service.engine.grammar_threads import MemoryTrimmer
from service.engine.mask_fill import MaskFiller
from service.engine.request import Constraint
from service.engine.structured import GrammarCompiler

_trimmer: MemoryTrimmer | None = None
_trimmer_lock = threading.Lock()


def trimmer() -> MemoryTrimmer:
    """The process's one trimmer (malloc's arenas are the process's)."""
    global _trimmer
    with _trimmer_lock:
        if _trimmer is None:
            _trimmer = MemoryTrimmer()
        return _trimmer


def mask_workers() -> int:
    """Mask workers for a step's constrained rows: masks are on every step's path, so as many as
    CPUs, 4 at most."""
    return min(4, host_cpus())


def host_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Constraints:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 limits: ConstraintLimits | None = None) -> None:
        self.limits = limits or ConstraintLimits()
        cpus = host_cpus()
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, limits=self.limits,
                                        on_free=trimmer().request)
        # Compiles run at the idle priority and on at most half the CPUs: a flood of them must leave the
        # threads that serve streams a core.
        self.preparer = ConstraintPreparer(self.compiler, self.limits, workers=max(1, cpus // 2),
                                           on_huge_freed=trimmer().request)
        self.masks = MaskFiller(vocab_size, workers=mask_workers(), budget_ms=self.limits.constraint_mask_timeout_ms,
                                on_abandoned_done=trimmer().request)

    def failed(self, c: Constraint) -> None:
        """A request's constraint failed after it was admitted: forget the compiled grammar and give
        the memory it grew back (once its matchers are gone)."""
        self.compiler.evict(c)
        trimmer().request()

    def close(self) -> None:
        """Stop the workers (a compile in progress finishes first, on its daemon thread)."""
        self.preparer.close()
        self.masks.close()
        self.compiler.close()
