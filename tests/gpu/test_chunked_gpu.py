"""Chunked prefill and mixed steps on the GPU: the eager step forward with the fast path (Triton
decode attention and RoPE/KV write on every row, bf16) gives each row what it gets alone, and the
engine in float32, with decode-only steps replayed from graphs, streams the same tokens with the
long prompt in chunks as in one step.

Run: python -m pytest tests/gpu/test_chunked_gpu.py -q -rs
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from cache_manager import CudaGraphMode
from service.model.builtin import ensure_builtin
from service.model.kv_cache import NULL_BLOCK, KVCache
from service.model.loader import LoadedModel, load_model
from service.model.pieces import PiecewiseForward
from service.model.step_batch import ChunkSpec, build_step_batch
from tests.gpu.test_kernels_gpu import _model, _rel, _spec
from tests.unit.test_chunked_engine import BUDGET, UNCHUNKED, requests, run

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")


def test_mixed_step_fast_path_matches_each_row_alone():
    spec = _spec()
    model = _model(spec, fast=True)
    assert model.fast.attention and model.fast.rope_kv
    gen = torch.Generator(DEVICE).manual_seed(3)
    p = {n: torch.randint(0, spec.vocab_size, (n,), device=DEVICE, generator=gen) for n in (300, 40, 17, 90)}

    def history() -> KVCache:
        kv = KVCache(spec, 5, 512, DEVICE, torch.bfloat16)
        model.prefill(p[300], 0, kv)  # decodes at 300
        model.prefill(p[40], 3, kv)  # decodes at 40
        model.prefill(p[90][:50], 1, kv)  # continues at 50
        return kv

    kv = history()
    ids = torch.cat([torch.tensor([5, 9], device=DEVICE), p[90][50:], p[17]])
    batch = build_step_batch([300, 40], [0, 3], [ChunkSpec(1, 50, 40), ChunkSpec(2, 0, 17)], ids,
                             kv.max_seq_len, kv.scratch_slot, DEVICE, pad_to=160)
    mixed = PiecewiseForward(model, kv).forward(batch)

    ref = history()
    alone = torch.cat([
        model.decode(torch.tensor([5, 9], device=DEVICE), torch.tensor([300, 40], device=DEVICE),
                     torch.tensor([0, 3], device=DEVICE), ref),
        model.prefill(p[90], 1, ref)[None],
        model.prefill(p[17], 2, ref)[None],
    ])
    assert _rel(mixed, alone) < 1e-2
    assert (mixed.argmax(-1) == alone.argmax(-1)).all()
    for layer in range(spec.num_layers):
        for a, b in ((kv.k[layer], ref.k[layer]), (kv.v[layer], ref.v[layer])):
            assert _rel(kv.slot_view(a)[:5].float(), ref.slot_view(b)[:5].float()) < 1e-2
            assert not a[NULL_BLOCK, :, 1:].any(), "padding wrote past position 0 of the scratch slot (the null block)"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    cache: pathlib.Path = tmp_path_factory.mktemp("cache")
    ensure_builtin("tiny", cache)
    return load_model("builtin:tiny", DEVICE, torch.float32, cache_dir=cache)


def test_engine_chunked_matches_unchunked_with_graphed_decodes(loaded: LoadedModel):
    reqs = requests(loaded)
    chunked, runner = run(loaded, reqs, BUDGET, graphs=CudaGraphMode.FULL)
    whole, _ = run(loaded, reqs, UNCHUNKED, graphs=CudaGraphMode.FULL)
    for r in reqs:
        assert chunked.summary(r.request_id) == whole.summary(r.request_id), r.request_id
    assert runner.runner.graphs.snapshot().used_bytes > 0  # the decode-only steps really replayed graphs
