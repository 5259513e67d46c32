"""FP8 weights on the CPU: quantization per output channel against hand-computed values, the
checkpoint layout vLLM and llm-compressor write (an FP8 weight beside its `weight_scale`) read from
real files, and the start-up errors where FP8 cannot run. The FP8 products run on the GPU
(tests/gpu/test_fp8_gpu.py)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.model import ModelLoadError, ensure_builtin, load_model
from service.model.fp8 import FP8, FP8_MAX, checkpoint_scales, dequantize_rows, quantize_rows
from tests.support.ranks import run_ranks

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_rows_quantize_to_their_own_scale_and_representable_values_come_back_exactly() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [896.0, 3.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale[0].item() == pytest.approx(1 / FP8_MAX) and scale[1].item() == 2.0
    assert q[0].float().tolist() == [448.0, -224.0, 112.0, 0.0]  # the row's largest maps to 448
    assert q[1].float().tolist() == [448.0, 1.5, -0.5, 0.0]
    assert torch.equal(dequantize_rows(q, scale)[:2], w[:2])
    assert scale[2] > 0 and not dequantize_rows(q, scale)[2].any()  # an all-zero row stays zero


def test_rounding_error_is_within_e4m3s_half_step() -> None:
    w = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    q, scale = quantize_rows(w)
    err = (dequantize_rows(q, scale) - w).abs()
    # 3 mantissa bits: a normal value is off by at most 2^-4 of itself; subnormals by half of 2^-9 x scale
    bound = w.abs() * 2.0**-4 + scale[:, None] * 2.0**-10
    assert (err <= bound * (1 + 1e-6)).all()
    assert torch.allclose(q.float().abs().amax(dim=1) * scale, w.abs().amax(dim=1), rtol=1e-6)  # maxima kept


def test_checkpoint_scales_per_channel_or_per_tensor() -> None:
    assert checkpoint_scales(torch.tensor(0.5), 3).tolist() == [0.5, 0.5, 0.5]
    assert checkpoint_scales(torch.tensor([0.25]), 2).tolist() == [0.25, 0.25]
    assert checkpoint_scales(torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16), 2).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="3 scales for a weight of 4 rows"):
        checkpoint_scales(torch.ones(3), 4)


def _fp8_checkpoint(src: pathlib.Path, dst: pathlib.Path, per_tensor: bool) -> dict[str, torch.Tensor]:
    """The built-in checkpoint with every projection in FP8 beside its scales (and a static input
    scale, as llm-compressor writes); returns the dequantized float32 weights it now stands for."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    state = load_file(str(weights))
    expected = {}
    for name in [n for n in state if n.endswith(".weight") and any(p in n for p in PROJECTIONS)]:
        w = state[name].float()
        if per_tensor:
            scale = (w.abs().max() / FP8_MAX).reshape(())
            q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            expected[name] = q.float() * scale
        else:
            q, rows = quantize_rows(w)
            scale = rows[:, None]  # [N, 1], as vLLM writes channel scales
            expected[name] = dequantize_rows(q, rows)
        state[name] = q
        state[name + "_scale"] = scale
        state[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
    save_file(state, str(weights))
    return expected


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path: pathlib.Path, per_tensor: bool) -> None:
    src = ensure_builtin("tiny", tmp_path / "cache")
    expected = _fp8_checkpoint(src, tmp_path / "fp8", per_tensor)
    model = load_model(str(tmp_path / "fp8"), CPU, torch.float32).model
    params = dict(model.named_parameters())
    for name, w in expected.items():
        assert torch.equal(params[name], w), name
    plain = load_model(str(src), CPU, torch.float32).model
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    original = plain.forward_full(ids)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name in expected:
                p.copy_(expected[name])
    logits = model.forward_full(ids)
    assert torch.equal(logits, plain.forward_full(ids))  # the model the FP8 checkpoint stands for
    assert not torch.equal(logits, original)  # (its weights were rounded)


def test_an_fp8_weight_without_its_weight_is_refused(tmp_path: pathlib.Path) -> None:
    src = ensure_builtin("tiny", tmp_path / "cache")
    shutil.copytree(src, tmp_path / "bad")
    weights = tmp_path / "bad" / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.0.mlp.nonexistent.weight_scale"] = torch.ones(4)
    save_file(state, str(weights))
    with pytest.raises(ModelLoadError, match="nonexistent.weight_scale has no weight"):
        load_model(str(tmp_path / "bad"), CPU, torch.float32)


def test_fp8_on_a_cpu_is_a_clear_load_error(tmp_path: pathlib.Path) -> None:
    src = ensure_builtin("tiny", tmp_path / "cache")
    with pytest.raises(ModelLoadError, match="--quantization fp8: FP8 needs an NVIDIA GPU of compute capability 8.9"):
        load_model(str(src), CPU, torch.float32, quantization="fp8")


def test_serve_with_fp8_on_a_cpu_fails_the_start_saying_what_to_change(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model-cache-dir", str(tmp_path), "--port", "0",
         "--admin-port", "0", "--metrics-port", "0", "--device", "cpu", "--quantization", "fp8"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--quantization fp8 needs an NVIDIA GPU" in proc.stdout + proc.stderr


def _fp8_rank(rank: int, world: int, port: int, model_dir: str) -> torch.Tensor:
    from service.engine.ranks import join_group

    tp, _ = join_group(rank, world, port, CPU)
    model = load_model(model_dir, CPU, torch.float32, tp=tp).model
    return model.forward_full(torch.tensor([[5, 17, 300, 42, 9, 1, 2]]))


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_an_fp8_checkpoint_splits_across_two_ranks_with_its_scales(tmp_path: pathlib.Path, per_tensor: bool) -> None:
    """Each rank reads its rows of a column-parallel weight with those rows' scales, and all of a
    row-parallel weight's scales (one per output channel) beside its columns: two gloo ranks give
    the logits of the whole checkpoint on one."""
    src = ensure_builtin("tiny", tmp_path / "cache")
    _fp8_checkpoint(src, tmp_path / "fp8", per_tensor)
    whole = load_model(str(tmp_path / "fp8"), CPU, torch.float32).model.forward_full(
        torch.tensor([[5, 17, 300, 42, 9, 1, 2]]))
    ranks = run_ranks(_fp8_rank, 2, str(tmp_path / "fp8"))
    for rank in (0, 1):
        torch.testing.assert_close(ranks[rank], whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),  # the 1B shape
                                  (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # the 8B shape
                                  (1280, 8192)])  # a 70B q/k/v shard at TP=8
def test_the_fp8_self_check_reaches_every_configuration_our_gemm_serves(monkeypatch, n: int, k: int) -> None:  # noqa: ANN001
    """The GEMM's tiles and K split depend on the rows: the start-up check must run each configuration
    served from 1 to 256 rows on an H200 (132 SMs), the GEMV at one row and cuBLAS where it serves."""
    from service.model import fp8
    from service.model.kernels import _triton
    from service.model.kernels.fp8_gemm import fp8_gemm_config

    monkeypatch.setattr(_triton, "sm_count", lambda device: 132)
    rows = fp8.check_rows(n, k, torch.device("cpu"))
    served = {fp8_gemm_config(m, n, k, 132) for m in range(1, 257)} - {None}
    checked = {fp8_gemm_config(m, n, k, 132) for m, routes in rows.items() if "gemm" in routes}
    assert checked == served and len(rows) <= len(served) + 3
    assert "gemv" in rows[1] and "cublas" in rows[1] and rows[max(rows)] == ["cublas"] and max(rows) > 256
