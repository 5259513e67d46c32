"""Built-in checkpoints: deterministic, complete, loadable, with a tokenizer that round-trips any text."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers

from service.model import BUILTIN_SHAPES, KVCache, ModelLoadError, ModelSpec, ensure_builtin, load_model
from service.model.builtin import write_tokenizer

CPU = torch.device("cpu")
TEXT = "héllo wörld 日本語 🙂"
REPO = pathlib.Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def files_of(path: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    cache = tmp_path_factory.mktemp("cache")
    ensure_builtin("tiny", cache)
    return cache


def test_generation_is_deterministic_across_processes(tiny_cache: pathlib.Path, tmp_path: pathlib.Path):
    # A second process with another hash seed must write the very same bytes.
    code = (
        "import pathlib, sys; from service.model import ensure_builtin; "
        "print(ensure_builtin('tiny', pathlib.Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    other = pathlib.Path(out.stdout.strip().splitlines()[-1])
    ours = ensure_builtin("tiny", tiny_cache)
    assert ours.name == other.name
    assert files_of(ours) == files_of(other)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        files_of(ours)
    )


def test_reused_when_complete_and_repaired_when_not(tiny_cache: pathlib.Path):
    path = ensure_builtin("tiny", tiny_cache)
    before = files_of(path)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny", tiny_cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not regenerated
    (path / "model.safetensors").unlink()
    assert ensure_builtin("tiny", tiny_cache) == path
    assert files_of(path) == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left behind


def test_concurrent_generation_yields_one_complete_dir(tmp_path: pathlib.Path):
    results: list[pathlib.Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_builtin("tiny", tmp_path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert [p.name for p in results[0].parent.iterdir()] == [results[0].name]


def test_loads_and_tokenizer_round_trips(tiny_cache: pathlib.Path):
    loaded = load_model("builtin:tiny", CPU, torch.float32, cache_dir=tiny_cache)
    tok, spec = loaded.tokenizer, loaded.spec
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert len(tok) == spec.vocab_size
    assert spec.bos_token_id == tok.bos_token_id and spec.eos_token_ids == (tok.eos_token_id,)
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == spec.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert all(isinstance(tok.decode([i]), str) for i in range(spec.vocab_size))  # every id decodes


def test_tiny_greedy_completion_is_varied(tiny_cache: pathlib.Path):
    loaded = load_model("builtin:tiny", CPU, torch.float32, cache_dir=tiny_cache)
    model, tok = loaded.model, loaded.tokenizer
    kv = KVCache(
        loaded.spec,
        num_slots=2,
        max_seq_len=loaded.spec.max_position_embeddings,
        device=CPU,
        dtype=torch.float32,
    )
    prompt = torch.tensor(tok("The service reads a request")["input_ids"])
    start = time.perf_counter()
    out = [int(model.prefill(prompt, 0, kv).argmax())]
    for i in range(63):
        logits = model.decode(torch.tensor([out[-1]]), torch.tensor([len(prompt) + i]), torch.tensor([0]), kv)
        out.append(int(logits[0].argmax()))
    elapsed = time.perf_counter() - start
    assert len(set(out)) > 3, out
    assert elapsed < 5.0  # ~0.15 s measured; only a gross regression should trip this


def test_unknown_name_lists_known(tmp_path: pathlib.Path):
    with pytest.raises(ModelLoadError, match="known: gemma3-4b, llama-1b, llama-8b, mixtral-8x7b, qwen3-30b-a3b, "
                       "qwen3-8b, tiny, tiny-gemma3, tiny-mixtral, tiny-qwen3, tiny-qwen3-moe"):
        ensure_builtin("nope", tmp_path)
    with pytest.raises(ModelLoadError, match="unknown builtin model 'nope'"):
        load_model("builtin:nope", CPU, torch.float32, cache_dir=tmp_path)


def test_llama_1b_shape_and_tokenizer(tmp_path: pathlib.Path):
    # Weights are never generated here (2.5 GB); shape and tokenizer are checked directly.
    shape = BUILTIN_SHAPES["llama-1b"]
    bos, eos = write_tokenizer(tmp_path, shape)
    assert (bos, eos) == (128000, 128001)  # Llama 3's ids
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == 128256
    assert tok.decode(tok(TEXT)["input_ids"], skip_special_tokens=True) == TEXT
    config = {k: v for k, v in shape.items() if k not in ("num_special", "dtype", "layer_std")}
    spec = ModelSpec.from_hf_config(transformers.LlamaConfig(**config))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        2048,
        16,
        32,
        8,
        64,
    )
    assert spec.tie_word_embeddings and spec.rope_theta == 500000.0 and spec.rope_scaling["factor"] == 32.0
