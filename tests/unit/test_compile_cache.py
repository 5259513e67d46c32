"""The compile cache on real files: what a damaged or unwritable directory does to a start (nothing
but a miss or a warning), and where Triton's compiled kernels go. Reuse across real starts:
tests/integration/test_startup.py."""

from __future__ import annotations

import torch

from service.model.kernels.compile_cache import CompileCache, environment_key
from service.model.kernels.fast_path import FastPath

KEY = {**environment_key(torch.device("cpu")), "dtype": "torch.bfloat16", "hidden_size": 64}


def test_results_come_back_for_the_same_key_only(tmp_path) -> None:
    cache = CompileCache(tmp_path)
    assert cache.store("fast_path", KEY, {"norm": True})
    assert cache.lookup("fast_path", KEY) == {"norm": True}
    assert cache.lookup("fast_path", {**KEY, "hidden_size": 128}) is None
    assert cache.lookup("fast_path", {**KEY, "torch": "0.0"}) is None


def test_a_damaged_file_is_a_miss_and_the_next_store_replaces_it(tmp_path) -> None:
    cache = CompileCache(tmp_path)
    cache.path("fast_path", KEY).write_text('{"key": {"dev')
    assert cache.lookup("fast_path", KEY) is None
    assert cache.store("fast_path", KEY, {"norm": False})
    assert cache.lookup("fast_path", KEY) == {"norm": False}
    assert [p.name for p in tmp_path.iterdir()] == [cache.path("fast_path", KEY).name]  # no temporary left


def test_a_directory_that_cannot_be_written_does_not_fail_the_start(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cache = CompileCache(blocker / "compile")
    assert cache.store("fast_path", KEY, {"norm": True}) is False
    assert cache.lookup("fast_path", KEY) is None


def test_triton_compiles_into_the_cache_unless_told_elsewhere(tmp_path) -> None:
    environ: dict[str, str] = {}
    CompileCache.open(tmp_path / "c", environ)
    assert environ["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton")
    environ = {"TRITON_CACHE_DIR": "/elsewhere"}
    CompileCache.open(tmp_path / "c", environ)
    assert environ["TRITON_CACHE_DIR"] == "/elsewhere"


def test_the_fast_path_takes_stored_results_without_checking_again(tmp_path) -> None:
    """Stored results are what the next build uses, with no check run (edited on disk here, to tell
    them apart from what a CPU's check gives: every kernel off)."""
    cache = CompileCache(tmp_path)
    args = (torch.device("cpu"), torch.float32, 4, 2, 16, 64, 128)
    assert FastPath.build(*args, cache=cache) == FastPath()
    [path] = tmp_path.glob("fast_path-*.json")
    record = path.read_text().replace('"norm": false', '"norm": true')
    path.write_text(record)
    assert FastPath.build(*args, cache=cache) == FastPath(norm=True)
