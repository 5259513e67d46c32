"""Speculative decoding with the real built-in model (float32) and the real engine: the output with
speculation on is the output with it off, token for token, greedy and seeded sampled, with the
n-gram proposer and with proposers that know (most of) the answer, so that long runs are accepted
and end inside a run: stop strings, EOS, max_tokens. Chunked prefill, prefix hits over blocks a
speculating request computed, and preemption keep the equality."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from cache_manager import CudaGraphMode, GraphCacheConfig
from service.config import SpeculativeConfig
from service.engine.engine import Engine
from service.engine.request import Finish, FinishReason, GenerationRequest, SamplingParams, TokenDelta
from service.engine.runner import ModelRunner
from service.engine.scheduler import Scheduler
from service.engine.spec.proposer import NgramProposer
from service.engine.spec.stats import SpecDecodeStats
from service.model.loader import LoadedModel
from tests.unit.test_overlap import Results as TokenResults


class Results(TokenResults):
    """Tokens, text and finishes, and the log-probabilities the deltas carried."""

    def sink(self, request_id: str):  # noqa: ANN201
        put = super().sink(request_id)
        self.logprobs = getattr(self, "logprobs", {})
        self.logprobs[request_id] = []
        self.prompt_logprobs = getattr(self, "prompt_logprobs", {})

        def put_and_record(event) -> None:  # noqa: ANN001
            for delta in (event, getattr(event, "final_delta", None)):
                if isinstance(delta, TokenDelta) and delta.logprobs:
                    self.logprobs[request_id] += delta.logprobs
                if isinstance(delta, TokenDelta) and delta.prompt_logprobs:
                    self.prompt_logprobs[request_id] = delta.prompt_logprobs
            put(event)
        return put_and_record


SLOTS = 4
MAX_SEQ = 512

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Oracle:
    """Proposes the continuation a reference run gave (every `corrupt`-th draft has its last token
    changed, so some drafts are rejected part way)."""

    def __init__(self, references: list[list[int]], corrupt: int = 0) -> None:
        self.references = references
        self.corrupt = corrupt
        self.calls = 0
        self.asked: set[str] = set()  # the requests it was asked to draft for

    def propose(self, seq, k: int) -> list[int]:  # noqa: ANN001
        self.calls += 1
        self.asked.add(seq.request_id)
        tokens = seq.token_ids(0, seq.num_tokens)
        for ref in self.references:
            if len(ref) > len(tokens) and ref[: len(tokens)] == list(tokens):
                draft = ref[len(tokens): len(tokens) + k]
                if self.corrupt and self.calls % self.corrupt == 0 and draft:
                    draft[-1] = (draft[-1] + 1) % 768
                return draft
        return []

    def finished(self, seq) -> None:  # noqa: ANN001
        pass


def run(loaded: LoadedModel, reqs: list[GenerationRequest], proposer=None, k: int = 4,  # noqa: ANN001
        budget: int = 64, num_blocks: int | None = None, eos: frozenset[int] | None = None,
        sequential: bool = False) -> tuple[Results, SpecDecodeStats, Scheduler]:
    config = GraphCacheConfig(mode=CudaGraphMode.NONE, capture_sizes=None, max_batch=SLOTS)
    runner = ModelRunner(loaded, SLOTS, MAX_SEQ, config, num_blocks=num_blocks)
    scheduler = Scheduler(SLOTS, budget, blocks=runner.new_block_pool(), proposer=proposer,
                          num_speculative_tokens=k if proposer is not None else 0)
    engine = Engine(runner, scheduler, loaded.tokenizer,
                    eos if eos is not None else frozenset(loaded.spec.eos_token_ids))
    out = Results()
    if sequential:  # one after the other: a later request finds the earlier one's blocks cached
        engine.start()
        for r in reqs:
            engine.submit(r, out.sink(r.request_id))
            out.wait([r.request_id], timeout=300)
    else:
        for r in reqs:  # queued before the engine starts: the same admissions in every run
            engine.submit(r, out.sink(r.request_id))
        engine.start()
        out.wait([r.request_id for r in reqs], timeout=300)
    engine.stop()
    scheduler.check()
    return out, engine.spec_stats, scheduler


def request(loaded: LoadedModel, rid: str, prompt: list[int] | str, max_tokens: int = 48, **params: object
            ) -> GenerationRequest:
    ids = loaded.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    sampling = SamplingParams(temperature=0.0, seed=5, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(rid, ids, replace(sampling, **params), arrival_time=time.monotonic())


def assert_same(a: Results, b: Results, reqs: list[GenerationRequest]) -> None:
    for r in reqs:
        assert a.summary(r.request_id) == b.summary(r.request_id), r.request_id


def assert_same_logprobs(a: Results, b: Results, request_id: str, n: int) -> None:
    """One per emitted token (accepted draft tokens included), equal within float32 noise (a verify
    row's logits come from the prompt-chunk path, a decode's from the decode path)."""
    assert len(a.logprobs[request_id]) == len(b.logprobs[request_id]) == n
    for x, y in zip(a.logprobs[request_id], b.logprobs[request_id], strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def references(out: Results, reqs: list[GenerationRequest]) -> list[list[int]]:
    return [r.prompt_token_ids + out.tokens[r.request_id] for r in reqs]


def test_ngram_greedy_and_sampled_equal_off_and_some_drafts_accepted(loaded):  # noqa: ANN001
    reqs = [request(loaded, "rep", "one two three one two three one two three one two", max_tokens=160),
            request(loaded, "hello", "hello hello hello hello", max_tokens=160),
            request(loaded, "sampled", "abc abc abc abc abc", max_tokens=160, temperature=0.8, top_p=0.95),
            request(loaded, "logprobs", "to be or not to be", max_tokens=40, logprobs=2)]
    off, _, _ = run(loaded, reqs)
    on, counts, _ = run(loaded, reqs, NgramProposer(SpeculativeConfig(num_speculative_tokens=3)), k=3)
    assert_same(off, on, reqs)
    assert counts.drafts > 0 and counts.accepted > 0  # the test could fail: drafts were verified and kept
    assert_same_logprobs(off, on, "logprobs", 40)


def test_long_accepted_runs_with_rejections_chunked_prefill_equal_off(loaded):  # noqa: ANN001
    long_prompt = [(7 * i) % 700 + 3 for i in range(300)]
    # The long prompt's chunks (with prompt logprobs) run in the steps of the others' verify rows.
    reqs = [request(loaded, "short", "The service reads a request", max_tokens=60, logprobs=3),
            request(loaded, "sampled", "Tokens stream back", max_tokens=60, temperature=1.0, seed=11),
            request(loaded, "long", long_prompt, max_tokens=40, prompt_logprobs=1)]
    off, _, _ = run(loaded, reqs, budget=32)  # the long prompt in chunks of at most 32 tokens
    on, counts, _ = run(loaded, reqs, Oracle(references(off, reqs), corrupt=3), k=5, budget=32)
    assert_same(off, on, reqs)
    assert_same_logprobs(off, on, "short", 60)
    prompt_off, prompt_on = off.prompt_logprobs["long"], on.prompt_logprobs["long"]
    assert len(prompt_off) == len(prompt_on) == len(long_prompt) - 1
    assert [x.logprob for x in prompt_on] == pytest.approx([x.logprob for x in prompt_off], abs=1e-4)
    # Two thirds of the drafts are right: most tokens came from accepted drafts, some were rejected.
    assert counts.accepted > 60 and counts.accepted < counts.draft_tokens


@pytest.mark.parametrize("where", [10, 23])
def test_stop_string_eos_and_max_tokens_inside_an_accepted_run(loaded, where):  # noqa: ANN001
    base = [request(loaded, "r", "Hello there, hello there", max_tokens=40)]
    off, _, _ = run(loaded, base)
    tokens = off.tokens["r"]
    oracle = Oracle(references(off, base))
    text = loaded.tokenizer.decode(tokens)

    # max_tokens: the last token allowed lies inside a run of 6 (drafts are cut to what is left).
    capped = [replace(base[0], sampling=replace(base[0].sampling, max_tokens=where))]
    a, _, _ = run(loaded, capped)
    b, counts, _ = run(loaded, capped, oracle, k=6)
    assert_same(a, b, capped)
    assert b.finish["r"].reason is FinishReason.LENGTH and len(b.tokens["r"]) == where and counts.accepted > 0

    # EOS: the token at `where` is the end-of-sequence token of both engines.
    eos = frozenset({tokens[where]})
    ended = [replace(base[0], sampling=replace(base[0].sampling, ignore_eos=False))]
    a, _, _ = run(loaded, ended, eos=eos)
    b, counts, _ = run(loaded, ended, Oracle(references(off, base)), k=6, eos=eos)
    assert_same(a, b, ended)
    finish = b.finish["r"]
    assert finish.reason is FinishReason.EOS and finish.completion_tokens == tokens.index(tokens[where]) + 1
    assert counts.accepted > 0

    # A stop string: the text of a few tokens around `where`.
    stop = loaded.tokenizer.decode(tokens[where: where + 2]).strip()
    assert stop and stop in text
    stopped = [replace(base[0], sampling=replace(base[0].sampling, stop=(stop,)))]
    a, _, _ = run(loaded, stopped)
    b, counts, _ = run(loaded, stopped, Oracle(references(off, base)), k=6)
    assert_same(a, b, stopped)
    assert isinstance(b.finish["r"], Finish) and b.finish["r"].reason is FinishReason.STOP and counts.accepted > 0
    assert stop not in b.text["r"]


def test_prefix_hit_on_blocks_a_speculating_request_computed(loaded):  # noqa: ANN001
    """The second request's prompt is the first's prompt and output: its prefill takes the blocks the
    first one computed while speculating (with rejections), which must hold only accepted tokens."""
    first = request(loaded, "first", "A story about a cat and a hat and a bat", max_tokens=70)
    off, _, _ = run(loaded, [first])
    follow = request(loaded, "follow", first.prompt_token_ids + off.tokens["first"][:64], max_tokens=30)
    both = [first, follow]
    off, _, _ = run(loaded, both, sequential=True)
    refs = references(off, both)
    on, counts, scheduler = run(loaded, both, Oracle(refs, corrupt=2), k=4, sequential=True)
    assert_same(off, on, both)
    stats = scheduler.block_stats()
    assert stats.prefix_hits >= 64 and counts.accepted > 0 and counts.accepted < counts.draft_tokens


def test_preemption_in_the_middle_of_speculative_runs(loaded):  # noqa: ANN001
    reqs = [request(loaded, f"p{i}", f"Request number {i} says hello", max_tokens=90) for i in range(4)]
    blocks = 1 + 4 * 6  # 24 blocks of 16 for four rows that each need 7: some are preempted
    off, _, off_scheduler = run(loaded, reqs, num_blocks=blocks)
    on, counts, scheduler = run(loaded, reqs, Oracle(references(off, reqs), corrupt=4), k=4, num_blocks=blocks)
    assert_same(off, on, reqs)
    assert scheduler.num_preemptions > 0 and counts.accepted > 0
