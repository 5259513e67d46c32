"""The host tier under the prefix cache: at most its bound of blocks, least recently used out first
(never one a pending copy reads), and its copies move every layer's keys and values exactly."""

from __future__ import annotations

import torch

from service.engine.block_pool import BlockPool
from service.engine.host_tier import HostTier, KvCopies
from service.model.host_kv import HostKV
from service.model.kv_cache import KVCache
from service.model.spec import ModelSpec

D1, D2, D3 = b"1" * 16, b"2" * 16, b"3" * 16


def test_the_tier_keeps_its_bound_and_drops_the_least_recently_used_first() -> None:
    tier = HostTier(2, 4, bytes_per_block=100)
    tier.offload(1, D1)
    tier.offload(2, D2)
    tier.pin(D1)  # D1 used again (about to be loaded): D2 is now the least recently used
    tier.load(D1, 5)
    tier.offload(3, D3)
    assert tier.cached_hashes() == {D1, D3}
    stats = tier.stats()
    assert (stats.cached, stats.bytes_used, stats.evictions, stats.hits) == (2, 200, 1, 1)
    copies = tier.take_copies()
    slot_of = {d: s for d, s in tier._slots.items()}
    assert copies == KvCopies(((1, copies.to_host[0][1]), (2, copies.to_host[1][1]), (3, slot_of[D3])),
                              ((slot_of[D1], 5),))
    tier.check()


def test_a_block_being_loaded_is_not_dropped_for_a_newcomer() -> None:
    tier = HostTier(1, 4)
    tier.offload(1, D1)
    tier.pin(D1)
    tier.offload(2, D2)  # no room but D1, which a pending copy reads: D2 is not kept
    assert tier.cached_hashes() == {D1}
    tier.take_copies()
    tier.offload(2, D2)
    assert tier.cached_hashes() == {D2}


def test_a_device_miss_found_in_the_tier_takes_a_new_block_and_counts_as_a_hit() -> None:
    pool = BlockPool(4, 4, host=HostTier(4, 4))  # 3 usable blocks
    blocks = pool.allocate(2)
    pool.register(blocks[0], D1)
    pool.register(blocks[1], D2)
    pool.free(blocks)
    pool.free(pool.allocate(3))  # every block reused: D1 and D2 evicted into the tier
    assert pool.cached_hashes() == set() and pool.host.cached_hashes() == {D1, D2}
    hit = pool.lookup([D1, D2, D3], 3)
    assert len(hit) == 2 and pool.cached_hashes() == {D1, D2}
    copies = pool.take_copies()
    assert [b for _, b in copies.to_device] == hit
    pool.free(hit)
    pool.check()
    assert pool.num_free == 3


def spec() -> ModelSpec:
    return ModelSpec(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                     rope_scaling=None, attention_bias=False, tie_word_embeddings=False, max_position_embeddings=64,
                     eos_token_ids=(), bos_token_id=None)


def test_copies_out_then_in_move_every_layer_exactly() -> None:
    kv = KVCache(spec(), 2, 32, torch.device("cpu"), torch.float32, block_size=4, num_blocks=8)
    torch.manual_seed(0)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in (*kv.k, *kv.v)]
    host = HostKV(kv, 3)
    host.run(to_host=((2, 1), (6, 0)))
    # Block 2's KV comes back into block 5, block 6's into block 2 (read out before overwritten).
    host.run(to_host=((5, 2),), to_device=((1, 5), (0, 2)))
    for t, old in zip((*kv.k, *kv.v), before, strict=True):
        assert torch.equal(t[5], old[2]) and torch.equal(t[2], old[6])
        assert torch.equal(t[1], old[1])
    assert torch.equal(host.blocks[2, 0, 1], before[1][5])  # the block evicted in the same step, layer 1's keys
