"""Chunked prefill and mixed steps in the model: a prompt prefilled over several chunks gives the
logits, KV cache and greedy continuation of one whole prefill (float32); one packed step of decodes,
prompt starts and prompt continuations gives each row what it gets alone; the forward split at
attention (the pieces) equals the unsplit forward; padding rows write only the scratch slot's null block."""

from __future__ import annotations

import pytest
import torch

from service.model.kv_cache import NULL_BLOCK, KVCache
from service.model.llama import LlamaForCausalLM
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec, StepBatch, build_step_batch

CPU = torch.device("cpu")
ATOL = 1e-5
NUM_SLOTS, MAX_SEQ = 5, 160
STEPS = 10

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def new_cache(model: LlamaForCausalLM) -> KVCache:
    return KVCache(model.spec, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ, device=CPU, dtype=torch.float32)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def batch_of(kv: KVCache, decodes: list[tuple[int, int, int]], chunks: list[tuple[list[int], ChunkSpec]],
             pad_to: int | None = None) -> StepBatch:
    """decodes: (token, position, slot); chunks: (the chunk's tokens, where they go)."""
    ids = [t for t, _, _ in decodes] + [t for tokens, _ in chunks for t in tokens]
    return build_step_batch([p for _, p, _ in decodes], [s for _, _, s in decodes], [c for _, c in chunks], ids,
                            kv.max_seq_len, kv.scratch_slot, CPU, pad_to=pad_to)


def prefill_in_chunks(model: LlamaForCausalLM, tokens: list[int], slot: int, kv: KVCache,
                      bounds: list[int]) -> torch.Tensor:
    """Prefills tokens over chunks [bounds[i], bounds[i+1]), one step each; the last chunk's logits."""
    logits = None
    for start, end in zip(bounds, bounds[1:]):
        last = end == len(tokens)
        batch = batch_of(kv, [], [(tokens[start:end], ChunkSpec(slot, start, end - start, sample=last))])
        logits = model.forward_step(batch, kv)
        assert logits.shape[0] == int(last)  # an unfinished prompt samples nothing
    assert logits is not None
    return logits[0]


def greedy(model: LlamaForCausalLM, first: torch.Tensor, position: int, slot: int, kv: KVCache) -> list[int]:
    tokens = [int(first.argmax())]
    for step in range(STEPS):
        logits = model.decode(torch.tensor([tokens[-1]]), torch.tensor([position + step]), torch.tensor([slot]), kv)
        tokens.append(int(logits[0].argmax()))
    return tokens


@pytest.mark.parametrize("bounds", [[0, 16, 40, 150], [0, 1, 2, 149, 150], [0, 75, 150]],
                         ids=["uneven", "tiny-chunks", "halves"])
def test_chunked_prefill_equals_one_prefill(random_llama, bounds):
    tokens = prompt(150, seed=1)
    kv_ref, kv = new_cache(random_llama), new_cache(random_llama)
    whole = random_llama.prefill(torch.tensor(tokens), 2, kv_ref)
    chunked = prefill_in_chunks(random_llama, tokens, 2, kv, bounds)
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)
    for cache, ref in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        torch.testing.assert_close(cache, ref, atol=ATOL, rtol=0)
    assert greedy(random_llama, chunked, 150, 2, kv) == greedy(random_llama, whole, 150, 2, kv_ref)


def mixed_step(model: LlamaForCausalLM, kv: KVCache, forward, pad_to: int | None = None) -> torch.Tensor:  # noqa: ANN001
    """Slots 0 and 3 decode; slot 1 continues its prompt at 20; slots 4 and 2 start prompts, one of
    them only partly (no logits). Rows are deliberately not in slot order."""
    decodes = [(7, 12, 3), (11, 30, 0)]
    chunks = [
        (prompt(50, seed=5)[20:50], ChunkSpec(1, 20, 30)),
        (prompt(9, seed=6), ChunkSpec(4, 0, 9)),
        (prompt(40, seed=7)[:25], ChunkSpec(2, 0, 25, sample=False)),
    ]
    return forward(batch_of(kv, decodes, chunks, pad_to))


def history(model: LlamaForCausalLM) -> KVCache:
    """The cache before the mixed step: slots 3 and 0 hold 12 and 30 positions, slot 1 its prompt's first 20."""
    kv = new_cache(model)
    model.prefill(torch.tensor(prompt(12, seed=2)), 3, kv)
    model.prefill(torch.tensor(prompt(30, seed=3)), 0, kv)
    model.prefill(torch.tensor(prompt(50, seed=5)[:20]), 1, kv)
    return kv


def test_mixed_step_gives_each_row_what_it_gets_alone(random_llama):
    kv = history(random_llama)
    logits = mixed_step(random_llama, kv, lambda b: random_llama.forward_step(b, kv))
    assert logits.shape == (4, random_llama.spec.vocab_size)  # 2 decodes, the completed continuation, the short prompt

    ref = history(random_llama)
    expected = [
        random_llama.decode(torch.tensor([7, 11]), torch.tensor([12, 30]), torch.tensor([3, 0]), ref),
        random_llama.prefill(torch.tensor(prompt(50, seed=5)), 1, ref)[None],
        random_llama.prefill(torch.tensor(prompt(9, seed=6)), 4, ref)[None],
    ]
    torch.testing.assert_close(logits, torch.cat(expected), atol=ATOL, rtol=0)
    # The partial prompt wrote exactly its 25 positions, as a whole prefill of them would.
    random_llama.prefill(torch.tensor(prompt(40, seed=7)[:25]), 2, ref)
    for cache, want in zip(kv.k + kv.v, ref.k + ref.v):
        torch.testing.assert_close(cache, want, atol=ATOL, rtol=0)
        rows = kv.slot_view(cache)
        assert not rows[2, :, 25:].any() and not rows[kv.scratch_slot].any()


def test_split_forward_equals_unsplit(random_llama, monkeypatch):
    kv_split, kv_whole = history(random_llama), history(random_llama)
    pieces = PiecewiseForward(random_llama, kv_split)
    attention_calls = []
    real = random_llama.step_attention
    monkeypatch.setattr(random_llama, "step_attention", lambda layer, *a, **kw: attention_calls.append(layer) or real(layer, *a, **kw))

    split = mixed_step(random_llama, kv_split, pieces.forward)
    # Every attention ran between pieces, eagerly, in layer order: L layers, L + 1 pieces.
    assert attention_calls == list(range(random_llama.spec.num_layers)) and pieces.num_pieces == random_llama.spec.num_layers + 1
    whole = mixed_step(random_llama, kv_whole, lambda b: random_llama.forward_step(b, kv_whole))
    torch.testing.assert_close(split, whole, atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(kv_split.k + kv_split.v, kv_whole.k + kv_whole.v))


def test_padding_rows_touch_only_the_scratch_slot(random_llama):
    kv_padded, kv = history(random_llama), history(random_llama)
    padded = mixed_step(random_llama, kv_padded, PiecewiseForward(random_llama, kv_padded).forward, pad_to=80)
    exact = mixed_step(random_llama, kv, PiecewiseForward(random_llama, kv).forward)
    torch.testing.assert_close(padded, exact, atol=ATOL, rtol=0)
    for a, b in zip(kv_padded.k + kv_padded.v, kv.k + kv.v):
        rows = slice(0, kv.scratch_slot)  # every sequence row
        torch.testing.assert_close(kv_padded.slot_view(a)[rows], kv.slot_view(b)[rows], atol=ATOL, rtol=0)
        assert not a[NULL_BLOCK, :, 1:].any()  # padding writes position 0 of the scratch slot (the null block) only


@pytest.mark.parametrize("chunks, message", [
    ([ChunkSpec(0, 150, 20)], "exceeds the KV cache length"),
    ([ChunkSpec(0, 0, 0)], "chunk 0 is empty"),
    ([ChunkSpec(1, 0, 2), ChunkSpec(1, 2, 2)], "share a KV slot"),
    ([ChunkSpec(NUM_SLOTS + 1, 0, 2)], "outside the KV cache's slots"),
])
def test_bad_steps_raise(random_llama, chunks, message):
    kv = new_cache(random_llama)
    with pytest.raises(ValueError, match=message):
        build_step_batch([], [], chunks, [0] * sum(c.length for c in chunks), MAX_SEQ, kv.scratch_slot, CPU)
