"""The transformers anchors of decode_bench, measured in the same call as our step: transformers'
LlamaForCausalLM with our weights, `generate()` (eager, ms per new token with prefill taken out) and
one decode step with StaticCache, eager and captured by hand as a CUDA graph. Any failure (the
StaticCache API moves between releases) is recorded under `errors` and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from typing import Any

import torch

from bench.common import time_ms, wall_ms


def hf_model(s: Any) -> Any:
    """transformers' LlamaForCausalLM with our weights: from the checkpoint directory when there is
    one, else built from the same config with our tensors copied in."""
    import transformers

    if s.path is not None:
        return transformers.LlamaForCausalLM.from_pretrained(str(s.path), dtype=s.dtype).to(s.device).eval()
    config = transformers.LlamaConfig(**{k: v for k, v in s.hf_config.items() if k != "torch_dtype"})
    with torch.device(s.device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=s.dtype)
    missing, unexpected = model.load_state_dict(s.model.state_dict(), strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return model.eval()


def anchor_generate(hf: Any, s: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """ms per generated token = (generate(N new) - generate(1 new)) / (N - 1): prefill excluded."""
    ids = torch.randint(0, s.model.spec.vocab_size - 300, (batch, args.anchor_prompt), device=s.device)
    n = args.anchor_new_tokens

    def gen(k: int) -> None:
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                    do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        gen(2)  # warm-up
        prefill_ms = wall_ms(lambda: gen(1), s.device)
        total_ms = wall_ms(lambda: gen(n), s.device)
    return {"batch": batch, "new_tokens": n, "prompt_tokens": args.anchor_prompt, "total_ms": total_ms,
            "prefill_ms": prefill_ms, "ms_per_token": (total_ms - prefill_ms) / (n - 1),
            "ms_per_token_incl_prefill": total_ms / n}


def anchor_static_step(hf: Any, s: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """One decode step of transformers + StaticCache at position `context`, eager and hand-captured."""
    from transformers import StaticCache

    row: dict[str, Any] = {"batch": batch}
    cache = StaticCache(config=hf.config, max_cache_len=args.context + 64)
    ids = torch.randint(0, s.model.spec.vocab_size, (batch, 1), device=s.device)
    pos = torch.full((1,), args.context, dtype=torch.long, device=s.device)

    def step() -> torch.Tensor:
        return hf(input_ids=ids, cache_position=pos, position_ids=pos.expand(batch, 1),
                  past_key_values=cache, use_cache=True).logits

    with torch.inference_mode():
        row["eager_ms"] = time_ms(step, s.device, max(5, args.iters // 3), 2)
        if s.device.type != "cuda":
            row["graph_error"] = "skipped: needs cuda"
            return row
        side = torch.cuda.Stream(s.device)
        side.wait_stream(torch.cuda.current_stream(s.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(s.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize(s.device)
        row["capture_ms"] = (time.perf_counter() - t0) * 1000.0
        row["graph_ms"] = time_ms(graph.replay, s.device, args.iters, args.warmup)
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
    del graph
    return row


def run(s: Any, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"generate": [], "static_cache": [], "errors": []}
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        hf = hf_model(s)
    except Exception as exc:  # noqa: BLE001 - anchors are optional context; record and go on
        out["errors"].append(f"loading transformers model: {type(exc).__name__}: {exc}")
        return out
    out["generate_ms_per_token"] = "(generate(N new) - generate(1 new)) / (N - 1): decode only, prefill excluded"
    for b in args.anchor_batch_list:
        try:
            out["generate"].append(anchor_generate(hf, s, b, args))
        except Exception as exc:  # noqa: BLE001
            out["errors"].append(f"generate batch {b}: {type(exc).__name__}: {exc}")
    for b in args.batch_list:
        try:
            out["static_cache"].append(anchor_static_step(hf, s, b, args))
        except Exception as exc:  # noqa: BLE001 - the StaticCache API moves between releases
            out["errors"].append(f"static cache batch {b}: {type(exc).__name__}: {exc}")
            out["static_cache"].append({"batch": b, "graph_error": f"{type(exc).__name__}: {exc}"})
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    del hf
    gc.collect()
    return out
