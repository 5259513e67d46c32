import pytest

from cache_manager import (
    BatchDescriptor,
    CudaGraphMode,
    PaddingTable,
    default_capture_sizes,
    parse_capture_sizes,
)


def test_default_sizes_are_powers_then_steps_of_eight():
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(5) == (1, 2, 4, 5)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(1) == (1,)


@pytest.mark.parametrize(
    ("n", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (17, 24), (64, 64)]
)
def test_batch_pads_to_smallest_allowed_size(n, bucket):
    assert PaddingTable(default_capture_sizes(64)).bucket_for(n) == bucket


def test_above_largest_size_is_eager():
    table = PaddingTable((1, 2, 4, 8))
    assert table.bucket_for(9) is None
    with pytest.raises(ValueError):
        table.bucket_for(0)


def test_parse_capture_sizes_sorts_and_dedups():
    assert parse_capture_sizes(" 8, 1,4,2 ,8", 16) == (1, 2, 4, 8)


@pytest.mark.parametrize("text", ["", "1,x", "0,1", "1,17", "1.5"])
def test_parse_capture_sizes_rejects(text):
    with pytest.raises(ValueError):
        parse_capture_sizes(text, 16)


def test_check_allowed_names_the_allowed_sizes():
    with pytest.raises(ValueError, match=r"allowed: \[1, 2, 4, 8\]"):
        PaddingTable((1, 2, 4, 8)).check_allowed([3])


def test_descriptor_is_a_hashable_key():
    a = BatchDescriptor(CudaGraphMode.FULL, 8)
    assert a == BatchDescriptor(CudaGraphMode.FULL, 8)
    assert len({a, BatchDescriptor(CudaGraphMode.FULL, 8), BatchDescriptor(CudaGraphMode.FULL, 16)}) == 2
