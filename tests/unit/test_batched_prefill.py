"""Packed prefill: several prompts in one forward pass give the same logits, KV cache and greedy
continuations as one prefill per prompt, and touch no other slot."""

from __future__ import annotations

import time

import pytest
import torch

from cache_manager import CudaGraphMode, GraphCacheConfig
from service.engine.kv_manager import KVManager
from service.engine.request import GenerationRequest, SamplingParams
from service.engine.runner import ModelRunner
from service.engine.scheduled_step import PrefillChunk, ScheduledStep
from service.engine.sequence import Sequence
from service.model.kv_cache import KVCache
from service.model.llama import LlamaForCausalLM
from service.model.loader import LoadedModel

CPU = torch.device("cpu")
ATOL = 1e-4
LENS = (1, 7, 13)
SLOTS = [3, 0, 2]  # not in prompt order; slots 1 and 4 stay unused
NUM_SLOTS, MAX_SEQ = 5, 48
STEPS = 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(random_llama: LlamaForCausalLM) -> LlamaForCausalLM:
    return random_llama


def prompts(lens: tuple[int, ...] = LENS, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen) for n in lens]


def new_cache(model: LlamaForCausalLM) -> KVCache:
    return KVCache(model.spec, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ, device=CPU, dtype=torch.float32)


def one_by_one(model: LlamaForCausalLM, ps: list[torch.Tensor], slots: list[int]) -> tuple[torch.Tensor, KVCache]:
    kv = new_cache(model)
    return torch.stack([model.prefill(p, s, kv) for p, s in zip(ps, slots)]), kv


def packed(model: LlamaForCausalLM, ps: list[torch.Tensor], slots: list[int]) -> tuple[torch.Tensor, KVCache]:
    kv = new_cache(model)
    return model.prefill_packed(torch.cat(ps), [len(p) for p in ps], slots, kv), kv


def greedy(model: LlamaForCausalLM, first: torch.Tensor, lens: list[int], slots: list[int], kv: KVCache) -> list[list[int]]:
    """STEPS batched decode steps from each prompt's first token (plus a padding row on the scratch slot)."""
    tokens = [[int(t)] for t in first.argmax(dim=-1)]
    for step in range(STEPS):
        ids = torch.tensor([t[-1] for t in tokens] + [0])
        positions = torch.tensor([n + step for n in lens] + [0])
        logits = model.decode(ids, positions, torch.tensor(slots + [kv.scratch_slot]), kv)
        for row, t in enumerate(tokens):
            t.append(int(logits[row].argmax()))
    return tokens


@pytest.mark.parametrize(("lens", "slots"), [
    (LENS, SLOTS),  # three length buckets, one prompt each
    ((5, 7, 8), SLOTS),  # one bucket, padded to 8
    ((6, 6, 6), SLOTS),  # equal lengths: one batched call, no copies
    ((9, 16, 3, 12), [3, 0, 2, 4]),  # a bucket of three out of order beside a lone short prompt
], ids=["buckets", "padded", "equal", "mixed"])
def test_packed_matches_per_prompt_logits_and_cache(model, lens, slots):
    ps = prompts(lens)
    expected, kv_ref = one_by_one(model, ps, slots)
    logits, kv = packed(model, ps, slots)
    assert logits.shape == (len(ps), model.spec.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # The cache-free reference agrees too (each prompt's last position).
    full = torch.stack([model.forward_full(p[None])[0, -1] for p in ps])
    torch.testing.assert_close(logits, full, atol=ATOL, rtol=0)

    for layer in range(model.spec.num_layers):
        for cache, ref in ((kv.k[layer], kv_ref.k[layer]), (kv.v[layer], kv_ref.v[layer])):
            cache, ref = kv.slot_view(cache), kv_ref.slot_view(ref)  # [slot, KVH, position, D]
            for p, slot in zip(ps, slots):
                n = len(p)
                torch.testing.assert_close(cache[slot, :, :n], ref[slot, :, :n], atol=ATOL, rtol=0)
                assert not cache[slot, :, n:].any(), "wrote past the prompt"
            for unused in sorted({*range(NUM_SLOTS + 1)} - set(slots)):
                assert not cache[unused].any(), f"unused slot {unused} was written"


def test_single_prompt_is_the_old_prefill(model):
    p = prompts((9,))[0]
    kv_a, kv_b = new_cache(model), new_cache(model)
    one = model.prefill(p, 1, kv_a)
    assert one.shape == (model.spec.vocab_size,)
    torch.testing.assert_close(model.prefill_packed(p, [9], [1], kv_b)[0], one, atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(kv_a.k + kv_a.v, kv_b.k + kv_b.v))


def test_greedy_decode_after_packed_prefill_matches(model):
    ps = prompts(seed=1)
    lens = [len(p) for p in ps]
    first_ref, kv_ref = one_by_one(model, ps, SLOTS)
    first, kv = packed(model, ps, SLOTS)
    assert greedy(model, first, lens, SLOTS, kv) == greedy(model, first_ref, lens, SLOTS, kv_ref)


def test_packed_prefill_overwrites_a_reused_slot(model):
    # A slot freed by a finished sequence still holds its KV; a packed prefill into it must give
    # the same logits as into a fresh cache (positions past the new prompt are never attended).
    ps = prompts(seed=2)
    kv = new_cache(model)
    model.prefill_packed(torch.cat(prompts((20, 20, 20), seed=3)), [20, 20, 20], SLOTS, kv)
    logits = model.prefill_packed(torch.cat(ps), list(LENS), SLOTS, kv)
    torch.testing.assert_close(logits, packed(model, ps, SLOTS)[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "lens, slots, message",
    [
        ([3, 0, 2], [0, 1, 2], "prompt 1 is empty"),
        ([4, MAX_SEQ + 1], [0, 1], f"prompt 1 of {MAX_SEQ + 1} tokens exceeds the KV cache length {MAX_SEQ}"),
        ([2, 3], [0], "2 prompt lengths but 1 slots"),
        ([2, 3], [0, 1], "sum to 5 but input_ids holds 6"),
        ([], [], "at least one prompt"),
        ([3, 3], [0, NUM_SLOTS + 1], "outside the KV cache's slots"),
        ([3, 3], [2, 2], "share a KV slot"),
    ],
)
def test_bad_input_raises(model, lens, slots, message):
    kv = new_cache(model)
    n = 6 if message.startswith("sum") else sum(lens)
    with pytest.raises(ValueError, match=message):
        model.prefill_packed(torch.zeros(n, dtype=torch.long), lens, slots, kv)
    assert not any(t.any() for t in kv.k + kv.v), "a rejected call wrote the cache"


def test_bad_single_prompt_raises(model):
    kv = new_cache(model)
    with pytest.raises(ValueError, match="empty"):
        model.prefill(torch.zeros(0, dtype=torch.long), 0, kv)
    with pytest.raises(ValueError, match="exceeds the KV cache length"):
        model.prefill(torch.zeros(MAX_SEQ + 1, dtype=torch.long), 0, kv)
    with pytest.raises(ValueError, match="1-D"):
        model.prefill_packed(torch.zeros(1, 4, dtype=torch.long), [4], [0], kv)


def test_runner_prefills_all_prompts_in_one_packed_call(model, monkeypatch):
    loaded = LoadedModel("random", None, model.spec, model, None, CPU, torch.float32)  # type: ignore[arg-type]
    config = GraphCacheConfig(mode=CudaGraphMode.NONE, capture_sizes=None, max_batch=NUM_SLOTS)
    runner = ModelRunner(loaded, NUM_SLOTS, MAX_SEQ, config)
    ps = prompts(seed=4)
    seqs = [
        Sequence(
            GenerationRequest(f"r{j}", p.tolist(), SamplingParams(temperature=0.0, max_tokens=4, seed=0),
                              arrival_time=time.monotonic()),
            slot=slot,
        )
        for j, (p, slot) in enumerate(zip(ps, SLOTS))
    ]
    kv = KVManager(runner.new_block_pool())
    for seq in seqs:  # what admission does: blocks for the prompt
        assert kv.admit(seq, seq.num_prompt_tokens, others_running=False) and kv.allocate(seq, seq.num_prompt_tokens)
    expected, kv_ref = one_by_one(model, ps, SLOTS)
    calls = []
    real = runner.pieces.hidden
    monkeypatch.setattr(runner.pieces, "hidden", lambda batch: calls.append(batch.size) or real(batch))
    monkeypatch.setattr(model, "prefill", lambda *a: pytest.fail("per-prompt prefill called"))

    step = ScheduledStep(prefills=tuple(PrefillChunk(seq, 0, seq.num_prompt_tokens) for seq in seqs),
                         table_updates=kv.take_table_updates())
    tokens = runner.step(step)
    assert calls == [sum(LENS)]
    assert tokens == expected.argmax(dim=-1).tolist()
    got, want = runner.kv.slot_view(runner.kv.k[0]), kv_ref.slot_view(kv_ref.k[0])
    for slot, n in zip(SLOTS, LENS):
        torch.testing.assert_close(got[slot, :, :n], want[slot, :, :n], atol=ATOL, rtol=0)
