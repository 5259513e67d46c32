"""Sampling's per-row logit processing in one pass over a row, in place, on the rows that use it:
grammar masks (structured outputs) and the presence / frequency / repetition penalties.

The torch paths are the reference and the CPU path; on CUDA the Triton kernels run once a self-check
against them passed on the device (any exception or mismatch keeps the torch path, logged once as
`sampling_kernel_disabled`). Each torch path makes several passes over a [rows, vocab] copy
(about 0.5 ms for 64 rows of a 128k vocabulary on an H200); a kernel reads each row once.
"""

from __future__ import annotations

import functools

import structlog
import torch

from service.model.kernels import bitmask as token_bitmask
from service.model.kernels._triton import cdiv, tl, triton

log = structlog.get_logger("graphserve.kernels")
_BLOCK = 2048


def apply_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[rows[i], v] = -inf where bit v of bitmask[i] is 0 (bitmask int32 [C, words], any device)."""
    constrained = logits[rows]
    token_bitmask.apply_bitmask(constrained, bitmask)
    logits[rows] = constrained


def apply_penalties_torch(logits: torch.Tensor, rows: torch.Tensor, history_rows: torch.Tensor, counts: torch.Tensor,
                          in_prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                          repetition: torch.Tensor) -> None:
    """On logits[rows[i]], with the token counts of history row history_rows[i]: the repetition
    penalty on every token of the prompt or the completion (positive logits divided by it, negative
    ones multiplied), then minus presence x (count > 0) + frequency x count."""
    count = counts[history_rows]  # [P, V]
    in_completion = count > 0
    x = logits[rows]
    factor = repetition.unsqueeze(1)
    seen = in_completion | in_prompt[history_rows]
    x = torch.where(seen, torch.where(x > 0, x / factor, x * factor), x)
    x = x - frequency.unsqueeze(1) * count - presence.unsqueeze(1) * in_completion
    logits[rows] = x


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if _use_triton(logits.device):
        _bitmask_triton(logits, rows, bitmask.to(logits.device, non_blocking=True))
    else:
        apply_bitmask_torch(logits, rows, bitmask)


def apply_penalties(logits: torch.Tensor, *args: torch.Tensor) -> None:
    if _use_triton(logits.device):
        _penalties_triton(logits, *args)
    else:
        apply_penalties_torch(logits, *args)


def _bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    assert logits.stride(1) == 1 and bitmask.is_contiguous()
    vocab = logits.shape[1]
    _bitmask_kernel[(rows.numel(), cdiv(vocab, _BLOCK))](
        logits, rows, bitmask, logits.stride(0), bitmask.shape[1], vocab, BLOCK=_BLOCK)


def _penalties_triton(logits: torch.Tensor, rows: torch.Tensor, history_rows: torch.Tensor, counts: torch.Tensor,
                      in_prompt: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                      repetition: torch.Tensor) -> None:
    assert logits.stride(1) == 1 and counts.is_contiguous() and in_prompt.is_contiguous()
    vocab = logits.shape[1]
    _penalties_kernel[(rows.numel(), cdiv(vocab, _BLOCK))](
        logits, rows, history_rows, counts, in_prompt.view(torch.uint8), presence, frequency, repetition,
        logits.stride(0), counts.stride(0), vocab, BLOCK=_BLOCK)


if triton is not None:

    @triton.jit
    def _bitmask_kernel(logits_ptr, rows_ptr, mask_ptr, stride, words, vocab, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        row = tl.load(rows_ptr + i).to(tl.int64)
        word = tl.load(mask_ptr + i * words + offs // 32, mask=inside, other=0)
        allowed = ((word >> (offs % 32)) & 1) != 0
        ptr = logits_ptr + row * stride + offs
        x = tl.load(ptr, mask=inside, other=0.0)
        tl.store(ptr, tl.where(allowed, x, float("-inf")), mask=inside)

    @triton.jit
    def _penalties_kernel(logits_ptr, rows_ptr, hist_ptr, counts_ptr, prompt_ptr, presence_ptr, frequency_ptr,
                          repetition_ptr, stride, hist_stride, vocab, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        row = tl.load(rows_ptr + i).to(tl.int64)
        hist = tl.load(hist_ptr + i).to(tl.int64)
        presence = tl.load(presence_ptr + i)
        frequency = tl.load(frequency_ptr + i)
        repetition = tl.load(repetition_ptr + i)
        count = tl.load(counts_ptr + hist * hist_stride + offs, mask=inside, other=0)
        in_prompt = tl.load(prompt_ptr + hist * hist_stride + offs, mask=inside, other=0) != 0
        ptr = logits_ptr + row * stride + offs
        x = tl.load(ptr, mask=inside, other=0.0)
        in_completion = count > 0
        x = tl.where(in_completion | in_prompt, tl.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * count.to(tl.float32) - presence * in_completion.to(tl.float32)
        tl.store(ptr, x, mask=inside)


def _use_triton(device: torch.device) -> bool:
    """Triton on this CUDA device once both kernels match the torch paths on random inputs."""
    if device.type != "cuda" or triton is None:
        return False
    # one check per card, whether it is named "cuda" or "cuda:0"
    return _triton_checked(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _triton_checked(index: int) -> bool:
    device = torch.device("cuda", index)
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        vocab, rows = 5000, torch.tensor([2, 0], device=device)
        logits = torch.randn(3, vocab, device=device, generator=gen) * 3
        mask = torch.randint(-2**31, 2**31 - 1, (2, cdiv(vocab, 32)), device=device, dtype=torch.int32, generator=gen)
        want, got = logits.clone(), logits.clone()
        apply_bitmask_torch(want, rows, mask)
        _bitmask_triton(got, rows, mask)
        ok = torch.equal(want, got)
        counts = torch.randint(0, 3, (4, vocab), device=device, dtype=torch.int32, generator=gen)
        in_prompt = torch.rand(4, vocab, device=device, generator=gen) < 0.1
        args = (rows, torch.tensor([3, 1], device=device), counts, in_prompt, torch.tensor([0.5, -0.3], device=device),
                torch.tensor([0.25, 1.0], device=device), torch.tensor([1.3, 0.8], device=device))
        want, got = logits.clone(), logits.clone()
        apply_penalties_torch(want, *args)
        _penalties_triton(got, *args)
        ok = ok and torch.allclose(want, got, rtol=1e-6, atol=1e-6)
    except Exception as exc:  # noqa: BLE001 - the torch path serves
        log.warning("sampling_kernel_disabled", device=str(device), error=repr(exc))
        return False
    if not ok:
        log.warning("sampling_kernel_disabled", device=str(device), error="mismatch with the torch path")
    return ok


def warm_up(vocab: int, device: torch.device) -> None:
    """Check and compile the kernels now, at the model's vocabulary (Triton specializes a kernel on
    its integer arguments' divisibility, so the self-check's 5,000 ids do not stand in for it): the
    first request with a grammar or penalties otherwise paid it on the engine thread, and every
    stream stalled with it (1.1-1.2 s on an H100 host whose Triton cache was cold:
    bench/results/h100-20261205-late-masks). A no-op where the torch paths serve."""
    if not _use_triton(device):
        return
    logits = torch.zeros(3, vocab, device=device)  # as the sampler's work copy: float32, contiguous rows
    rows = torch.tensor([2, 0], device=device)
    apply_bitmask(logits, rows, torch.full((2, cdiv(vocab, 32)), -1, dtype=torch.int32, device=device))
    counts = torch.zeros(2, vocab, dtype=torch.int32, device=device)
    factors = torch.ones(2, device=device)
    apply_penalties(logits, rows, torch.tensor([0, 1], device=device), counts, counts != 0, factors, factors, factors)
    torch.cuda.synchronize(device)
