"""The persistent input batch's decode rows: whatever the engine does between launches (sequences
joining after their prompt, finishing, preempted, reordered, tokens read early), each launch's rows
equal the rows built from the sequences themselves."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.input_batch import DecodeRowInputs, InputBatch, rebuild
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.scheduled_step import PrefillChunk, ScheduledStep
from service.engine.sequence import Sequence, SequenceStatus

OPS = st.sampled_from(["step", "step", "step", "step", "join", "finish", "preempt", "swap", "drain"])


def _seq(i: int, slot: int) -> Sequence:
    request = GenerationRequest(f"r{i}", list(range(1, 3 + i % 5)), SamplingParams(max_tokens=10**6, seed=0))
    return Sequence(request, status=SequenceStatus.RUNNING, slot=slot)


def build(batch: InputBatch, decodes: list[Sequence], prefilling: Iterable[Sequence] = ()) -> DecodeRowInputs:
    """A launch of the decodes and of a prompt chunk completing each prefilling prompt: its decode rows."""
    step = ScheduledStep(tuple(decodes), tuple(PrefillChunk(s, 0, s.prefill_len) for s in prefilling))
    inputs = batch.build(step)
    d = len(decodes)
    return DecodeRowInputs(inputs.token_ids[:d], inputs.positions, inputs.slots, inputs.pending_rows or [-1] * d)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, min_size=1, max_size=60), st.integers(0, 2**16))
def test_reused_rows_equal_rows_rebuilt_from_the_sequences(ops: list[str], seed: int) -> None:
    import random

    rng = random.Random(seed)
    rows, decodes, prefilling = InputBatch(), [], []  # prefilling: a prompt chunk in the next launch
    previous: tuple[Sequence, ...] = ()  # the last launch's sampling order
    made = 0
    for op in ops:
        if op == "join" or not decodes and not prefilling:
            made += 1
            prefilling.append(_seq(made, slot=made))
        elif op == "finish" and decodes:
            decodes.pop(rng.randrange(len(decodes)))
        elif op == "preempt" and decodes:  # back to waiting; re-admitted, its KV recomputed by a prompt chunk
            s = decodes.pop(rng.randrange(len(decodes)))
            s.num_pending, s.slot = 0, s.slot + 1000
            prefilling.append(s)
        elif op == "swap" and len(decodes) > 1:
            i, j = rng.sample(range(len(decodes)), 2)
            decodes[i], decodes[j] = decodes[j], decodes[i]
        elif op == "drain":  # the step in flight is read before the next launch (operator calls)
            for s in decodes:
                if s.num_pending:
                    s.num_pending = 0
                    s.completion_token_ids.append(7)
        # A launch: its decodes, then the prompt chunks that complete (each samples a first token).
        expected = rebuild(tuple(decodes), previous)
        assert build(rows, decodes, prefilling) == expected
        sampling = decodes + prefilling
        previous = tuple(sampling)
        for s in decodes:  # this launch's token is in flight; the last launch's is read now
            if s.num_pending:
                s.completion_token_ids.append(5)
            else:
                s.num_pending = 1
        for s in prefilling:
            s.num_pending = 1
        decodes, prefilling = sampling, []


def test_steady_decoding_reuses_the_rows_and_advances_them() -> None:
    seqs = [_seq(i, slot=i) for i in range(3)]
    rows = InputBatch()
    previous: tuple[Sequence, ...] = ()
    for step in range(10):
        built = build(rows, seqs)
        assert built == rebuild(tuple(seqs), previous)
        assert built.positions == [s.num_prompt_tokens - 1 + step for s in seqs]  # one further per launch
        previous = tuple(seqs)
        for s in seqs:
            if s.num_pending:
                s.completion_token_ids.append(5)
            s.num_pending = 1
    assert rows.reused == 9  # every launch after the first
