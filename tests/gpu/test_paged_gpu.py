"""The paged KV cache on a real GPU: the Triton decode and prompt-chunk kernels over block tables
against the torch reference (block sizes, lengths, shuffled and shared layouts), a captured decode graph replayed with
other block tables equal to eager, prefix-cache hits under graphs giving a miss's tokens, and the
batch-invariant mode identical with and without a prefix hit.

Run: python -m pytest tests/gpu/test_paged_gpu.py -q -rs
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("batch, max_seq_len, splits", [(1, 600, None), (7, 333, None), (64, 4096, None), (5, 250, 3)])
def test_paged_decode_kernel_matches_the_torch_reference(block_size, batch, max_seq_len, splits):
    from service.model.kernels.fast_path import check_attention

    for seed in range(2):
        check_attention(DEVICE, torch.bfloat16, 32, 8, 64, batch=batch, max_seq_len=max_seq_len, num_splits=splits,
                        seed=seed, block_size=block_size)


CHUNK_SETS = [
    ((0, 1),),  # a one-token prompt
    ((0, 2048),),  # one long prompt: 32 query tiles
    ((1024, 270), (1024, 300), (0, 9)),  # prefix-cache hits beside a miss
    ((0, 63), (0, 64), (0, 65), (500, 129), (4000, 96)),  # tile edges, a late chunk
]


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("chunks", CHUNK_SETS, ids=lambda c: f"{len(c)}chunks")
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 8, 128), (8, 8, 64)], ids=lambda h: "x".join(map(str, h)))
def test_prompt_chunk_kernel_matches_the_torch_reference(block_size, chunks, heads):
    from service.model.kernels.fast_path import check_prefill_attention

    longest = max(start + n for start, n in chunks)
    for seed in range(2):
        check_prefill_attention(DEVICE, torch.bfloat16, *heads, chunks=chunks, seed=seed, block_size=block_size,
                                max_seq_len=longest + 17)


def _model():
    from service.model.llama import LlamaForCausalLM
    from service.model.spec import ModelSpec

    spec = ModelSpec(architecture="LlamaForCausalLM", vocab_size=4096, hidden_size=512, intermediate_size=1408,
                     num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=None, attention_bias=False, tie_word_embeddings=False, max_position_embeddings=2048,
                     eos_token_ids=(), bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(spec, DEVICE, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def test_a_decode_graph_replays_with_other_block_tables_like_eager():
    """One graph captured over one block layout; the KV moved to other blocks (and the table with it)
    between replays: every replay equals the eager step over the same layout."""
    from service.model.kv_cache import KVCache

    model = _model()
    spec = model.spec
    slots, max_seq, bs = 4, 256, 16
    per_seq = max_seq // bs
    kv = KVCache(spec, slots, max_seq, DEVICE, torch.bfloat16, bs, num_blocks=1 + 2 * slots * per_seq)
    lengths = [37, 200, 5, 129]
    ids = torch.randint(0, spec.vocab_size, (slots,), device=DEVICE)
    positions = torch.tensor(lengths, device=DEVICE)
    slot_ids = torch.arange(slots, device=DEVICE)

    def layout(seed: int) -> None:
        blocks = (1 + torch.randperm(kv.num_blocks - 1, generator=torch.Generator().manual_seed(seed))).tolist()
        for s in range(slots):
            kv.set_blocks(s, 0, blocks[s * per_seq:(s + 1) * per_seq])
        kv.sync_table()

    layout(0)
    for layer in range(spec.num_layers):  # random context in every block
        kv.k[layer].normal_()
        kv.v[layer].normal_()
    static = [t.clone() for t in (ids, positions, slot_ids)]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        model.decode(*static, kv)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model.decode(*static, kv)
    for seed in (0, 5, 9):
        old_table = kv.block_table.clone()
        saved_k = [k.clone() for k in kv.k]
        saved_v = [v.clone() for v in kv.v]
        layout(seed)
        new_table = kv.block_table
        for layer in range(spec.num_layers):  # move each row's KV to its new blocks
            for s in range(slots):
                kv.k[layer][new_table[s].long()] = saved_k[layer][old_table[s].long()]
                kv.v[layer][new_table[s].long()] = saved_v[layer][old_table[s].long()]
        snapshot_k, snapshot_v = [k.clone() for k in kv.k], [v.clone() for v in kv.v]
        graph.replay()
        replayed = out.clone()
        for layer in range(spec.num_layers):  # the same step eagerly, from the same cache
            kv.k[layer].copy_(snapshot_k[layer])
            kv.v[layer].copy_(snapshot_v[layer])
        eager = model.decode(*static, kv)
        assert torch.equal(replayed, eager), f"layout {seed}: replay differs from eager"


def test_prefix_hits_under_graphs_give_the_tokens_of_a_miss():
    from service.llm import LLM, SamplingParams

    shared = list(range(10, 10 + 300))
    prompts = [shared + [500 + i, 600 + i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    results = {}
    for caching in (False, True):
        llm = LLM("builtin:tiny", device="cuda", dtype="float32", enable_prefix_caching=caching)
        try:
            results[caching] = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]  # one at a time: hits
            stats = llm._engine.engine.scheduler.block_stats()
            replays = sum(b.since_start.replays for b in llm.graph_cache_state().buckets)
        finally:
            llm.close()
        assert replays > 0, "no graph was replayed"
        if caching:
            assert stats.prefix_hits >= 5 * 288, stats  # each later prompt found the shared full blocks
    assert results[True] == results[False]


def test_batch_invariant_mode_is_identical_with_and_without_a_prefix_hit():
    from service.llm import LLM, SamplingParams

    prompt = list(range(20, 20 + 200))
    params = SamplingParams(max_tokens=32, temperature=0.0)
    llm = LLM("builtin:tiny", device="cuda", dtype="bfloat16", batch_invariant=True)
    try:
        miss = llm.generate(prompt, params)[0].outputs[0].token_ids
        hit = llm.generate(prompt, params)[0].outputs[0].token_ids
        stats = llm._engine.engine.scheduler.block_stats()
    finally:
        llm.close()
    assert stats.prefix_hits >= 192
    assert hit == miss
