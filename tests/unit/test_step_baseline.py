"""The closed loop's baseline step is timed at the contexts the workload's decode rows have, and
averaged over a request's life."""

from __future__ import annotations

import argparse

import pytest

from bench.step_baseline import contexts, life_mean, server_model_args


def test_the_contexts_span_a_requests_decode_rows() -> None:
    assert contexts(32, 256) == [32, 159, 286]  # the second token decodes at 32, the last at 32 + 254
    assert contexts(128, 2) == [128] and contexts(128, 1) == [128]


def test_a_step_linear_in_its_context_averages_to_its_middle() -> None:
    assert life_mean({32: 1.0, 159: 2.0, 286: 3.0}) == pytest.approx(2.0)
    assert life_mean({32: 1.0, 159: 1.0, 286: 4.0}) == pytest.approx(1.75)
    assert life_mean({128: 2.5}) == 2.5


def test_the_step_is_built_as_the_server_ran() -> None:
    args = argparse.Namespace(model="builtin:llama-1b", cache_dir=None, device="cpu", dtype="bfloat16",
                              server_args="--stream-message-rate 0 --quantization fp8 --kv-cache-dtype fp8")
    built = server_model_args(args)
    assert (built.quantization, built.kv_cache_dtype, built.random_init, built.batch_invariant) == ("fp8", "fp8", True, False)
