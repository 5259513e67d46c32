"""A constrained decode whose grammar mask is late sits its step out: the engine voids that row's
token, does not schedule the sequence until the mask is done, then computes the same position again.
With the real built-in model and grammar library, every request's tokens, text and finish are those
of a run where no mask is late, and nothing is left behind. (What the other streams gain is measured
by bench/hostile_constraints.py.)"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import replace

import pytest

from cache_manager import CudaGraphMode, GraphCacheConfig
from service.engine.constraints import Constraints
from service.engine.engine import Engine
from service.engine.request import GenerationRequest
from service.engine.runner import ModelRunner
from service.engine.sampling_params import Constraint, SamplingParams
from service.engine.scheduler import Scheduler
from service.engine.structured import Matcher
from service.model.loader import LoadedModel
from tests.unit.test_overlap import Results

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLOTS = 5
REGEX = r"[a-z]{3,8}( [a-z]{3,8}){2,5}\."
LATE_S = 0.03  # a late mask's wall time: 12x the step's wait for masks (a quarter of the 10 ms budget), no CPU


def requests(loaded: LoadedModel) -> list[GenerationRequest]:
    regex = Constraint("regex", REGEX)
    greedy = SamplingParams(temperature=0.0, seed=0, max_tokens=40)
    specs = [
        replace(greedy, constraint=regex),
        # Penalties: a void token must not count in the history they read.
        replace(greedy, presence_penalty=2.0, frequency_penalty=2.0, constraint=regex),
        replace(greedy, temperature=0.8, seed=7, repetition_penalty=1.3, constraint=regex),
        replace(greedy, constraint=Constraint("choice", ("alpha beta", "gamma delta epsilon"))),
        replace(greedy, ignore_eos=True, max_tokens=30),  # unconstrained: it never waits for a mask
    ]
    return [GenerationRequest(f"r{i}", loaded.tokenizer("The service reads")["input_ids"], s,
                              arrival_time=time.monotonic()) for i, s in enumerate(specs)]


def run(loaded: LoadedModel, graphs: CudaGraphMode = CudaGraphMode.NONE) -> tuple[Results, Engine, Constraints]:
    constraints = Constraints(loaded.tokenizer, loaded.spec.vocab_size, loaded.spec.eos_token_ids)
    runner = ModelRunner(loaded, SLOTS, 160, GraphCacheConfig(mode=graphs, capture_sizes=None, max_batch=SLOTS),
                         masks=constraints.masks)
    engine = Engine(runner, Scheduler(SLOTS, max_num_batched_tokens=64), loaded.tokenizer,
                    frozenset(loaded.spec.eos_token_ids), overlap=True, constraints=constraints)
    out = Results()
    reqs = requests(loaded)
    for r in reqs:
        engine.submit(r, out.sink(r.request_id))
    engine.start()
    out.wait([r.request_id for r in reqs])
    engine.call(lambda: None).result(10)  # the step after: a launch still in flight (surplus rows) is read
    assert not engine.call(engine.has_pending_work).result(10)  # nothing left behind
    engine.stop()
    return out, engine, constraints


def make_masks_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fourth mask a mask worker computes (so each row's turn comes) takes LATE_S longer (the compile workers' first masks
    do not): the real grammar, as late as an expensive one, without spending its CPU budget."""
    fill, calls = Matcher.fill_bitmask, itertools.count()

    def late_fill(self: Matcher, bitmask, row: int) -> None:  # noqa: ANN001
        if threading.current_thread().name.startswith("graphserve-grammar-mask") and next(calls) % 4 == 3:
            time.sleep(LATE_S)
        fill(self, bitmask, row)

    monkeypatch.setattr(Matcher, "fill_bitmask", late_fill)


def test_late_masks_change_no_output_and_leave_nothing_behind(loaded: LoadedModel,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    on_time, _, _ = run(loaded)
    make_masks_late(monkeypatch)
    late, engine, constraints = run(loaded)
    assert constraints.masks.sat_out_rows >= 5, constraints.masks.sat_out_rows  # rows did sit out
    assert constraints.masks.failed_rows == 0
    for r in requests(loaded):
        assert late.summary(r.request_id) == on_time.summary(r.request_id), r.request_id
    assert all(re.fullmatch(REGEX, late.text[f"r{i}"]) for i in range(3)), late.text
    assert late.text["r3"] in ("alpha beta", "gamma delta epsilon")
    assert engine.scheduler.num_free_slots == SLOTS
