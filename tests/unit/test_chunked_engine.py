"""The engine with chunked prefill, real built-in model (float32): a 5,000-token prompt is prefilled
over several steps beside three decoding requests, which decode in every one of those steps, and
every request streams the same tokens as with the whole prompt in one step and as when it runs alone."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from cache_manager import CudaGraphMode, GraphCacheConfig
from service.engine.engine import Engine
from service.engine.request import FinishReason, GenerationRequest, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.model.loader import LoadedModel
from tests.unit.test_overlap import RecordingRunner, Results

SLOTS = 4
LONG = 5000
# The tiny model's config says 2048 positions, but nothing in the model limits them (RoPE is computed
# per position): a 5,120-position KV cache serves the 5,000-token prompt exactly.
MAX_SEQ = 5120
BUDGET = 1024  # five chunks of the long prompt beside the decodes
UNCHUNKED = LONG + 64  # the whole prompt in one step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def requests(loaded: LoadedModel) -> list[GenerationRequest]:  # noqa: F811
    tok = loaded.tokenizer
    greedy = SamplingParams(temperature=0.0, seed=0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    long_prompt = torch.randint(0, loaded.spec.vocab_size, (LONG,), generator=torch.Generator().manual_seed(0))
    shorts = [
        GenerationRequest(f"d{i}", tok(text)["input_ids"], replace(params, max_tokens=24, ignore_eos=True),
                          arrival_time=time.monotonic())
        for i, (text, params) in enumerate([("The service reads a request", greedy), ("Tokens stream back", sampled),
                                            ("Hello", greedy)])
    ]
    long = GenerationRequest("long", long_prompt.tolist(), replace(greedy, max_tokens=8, ignore_eos=True),
                             arrival_time=time.monotonic())
    return [*shorts, long]


def run(loaded: LoadedModel, reqs: list[GenerationRequest], budget: int,  # noqa: F811
        graphs: CudaGraphMode = CudaGraphMode.NONE) -> tuple[Results, RecordingRunner]:
    config = GraphCacheConfig(mode=graphs, capture_sizes=None, max_batch=SLOTS)
    runner = RecordingRunner(ModelRunner(loaded, SLOTS, MAX_SEQ, config))
    steps: list[tuple[list[str], list[tuple[str, int, int]]]] = []
    launch = runner.launch

    def record(step):  # noqa: ANN001, ANN202
        steps.append(([s.request_id for s in step.decodes], [(c.seq.request_id, c.start, c.end) for c in step.prefills]))
        assert len(step.decodes) + sum(c.num_tokens for c in step.prefills) <= budget
        return launch(step)

    runner.launch = record  # type: ignore[method-assign]
    runner.steps = steps  # type: ignore[attr-defined]
    engine = Engine(runner, Scheduler(SLOTS, budget), loaded.tokenizer, frozenset(loaded.spec.eos_token_ids))
    out = Results()
    for r in reqs:  # queued before the engine starts: the same admissions in every run
        engine.submit(r, out.sink(r.request_id))
    engine.start()
    out.wait([r.request_id for r in reqs], timeout=300)
    engine.stop()
    return out, runner


def test_long_prompt_in_chunks_beside_three_decodes_matches_unchunked_and_alone(loaded):  # noqa: F811
    reqs = requests(loaded)
    chunked, runner = run(loaded, reqs, BUDGET)
    whole, whole_runner = run(loaded, reqs, UNCHUNKED)
    for r in reqs:
        alone, _ = run(loaded, [r], BUDGET)
        assert chunked.summary(r.request_id) == whole.summary(r.request_id) == alone.summary(r.request_id), r.request_id
    assert chunked.finish["long"].reason is FinishReason.LENGTH and len(chunked.tokens["long"]) == 8

    long_steps = [(decodes, c) for decodes, chunks in runner.steps for c in chunks if c[0] == "long"]
    # Contiguous chunks cover the prompt in order, over several steps...
    assert [c[1:] for _, c in long_steps] == list(zip([0] + [c[2] for _, c in long_steps[:-1]],
                                                      [c[2] for _, c in long_steps]))
    assert long_steps[-1][1][2] == LONG and len(long_steps) >= 5
    # ...and after the first, every one of those steps also decodes the three short requests.
    assert all(sorted(decodes) == ["d0", "d1", "d2"] for decodes, _ in long_steps[1:])
    # Unchunked, the whole prompt went in one step.
    assert [c for _, chunks in whole_runner.steps for c in chunks if c[0] == "long"] == [("long", 0, LONG)]
