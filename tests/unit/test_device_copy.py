"""One copy per step to the device, every view 16-byte aligned whatever the lengths before it
(Triton compiles a kernel once per pointer alignment: an unaligned view was a compile while serving)."""

from __future__ import annotations

import torch

from service.model.device_copy import copy_parts
from service.model.step_batch import ChunkSpec, build_step_batch


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def test_parts_keep_their_values_and_each_starts_aligned() -> None:
    parts = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9]]
    views = copy_parts(parts, torch.long, "cpu")
    assert [v.tolist() for v in views] == parts
    assert all(_aligned(v) for v in views if v.numel())
    floats = copy_parts([[0.5], [1.5, 2.5, 3.5], [4.5]], torch.float32, "cpu")
    assert [v.tolist() for v in floats] == [[0.5], [1.5, 2.5, 3.5], [4.5]] and all(map(_aligned, floats))


def test_a_step_batch_of_odd_counts_has_only_aligned_inputs() -> None:
    # 3 decodes and a 4-token chunk: 7 rows, 4 sampling rows, and a prompt-logprob part of 3.
    batch = build_step_batch([4, 9, 2], [0, 1, 2], [ChunkSpec(3, 0, 4, True, 3)], list(range(7)), 64, 5,
                             torch.device("cpu"), lora_slots=[0, 1, 0, 0, 0, 0, 0])
    for name in ("input_ids", "positions", "slot_ids", "sample_rows", "logprob_rows", "lora_slots"):
        assert _aligned(getattr(batch, name)), name
    assert batch.positions.tolist() == [4, 9, 2, 0, 1, 2, 3]
    assert batch.slot_ids.tolist() == [0, 1, 2, 3, 3, 3, 3] and batch.input_ids.tolist() == list(range(7))
    assert batch.sample_rows.tolist() == [0, 1, 2, 6] and batch.logprob_rows.tolist() == [3, 4, 5]
