"""The gpt-fast anchor of decode_bench, measured in the same process and call as our step.

gpt-fast's model (bench/anchors/gpt_fast_model.py, vendored, BSD-3-Clause) is built with our model's
shape and our weights (the checkpoint layout converted as gpt-fast's convert_hf_checkpoint.py does;
a tied head stays tied, so both read the same bytes), its KV cache sized as decode_bench sizes ours
(context + 64 positions), and one decode step is compiled as gpt-fast's generate.py compiles it
(torch.compile mode="reduce-overhead", fullgraph, math attention for Inductor to generate). The step
timed is the forward of one token per row at position `context` to float32-able logits, as ours
(`ModelDecodeStep.run`): gpt-fast's sampling is left out, as our sampler is. Each batch records its
median, every sample and the compile time; `compile="none"` runs eagerly (a CPU check).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bench.anchors.gpt_fast_model import ModelArgs, Transformer
from bench.common import time_samples_ms
from service.model import ModelSpec

SOURCE = "pytorch-labs/gpt-fast model.py at 32971d3 (vendored, BSD-3-Clause)"


def model_args(spec: ModelSpec, max_seq_len: int) -> ModelArgs:
    scaling = spec.rope_scaling
    if spec.attention_bias or spec.head_dim * spec.num_heads != spec.hidden_size:
        raise ValueError("gpt-fast's model has no attention bias and head_dim = dim / n_head")
    return ModelArgs(
        block_size=max_seq_len, vocab_size=spec.vocab_size, n_layer=spec.num_layers, n_head=spec.num_heads,
        dim=spec.hidden_size, intermediate_size=spec.intermediate_size, n_local_heads=spec.num_kv_heads,
        rope_base=spec.rope_theta, norm_eps=spec.rms_norm_eps,
        rope_scaling=None if scaling is None else {k: scaling[k] for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")},
    )


def from_hf_state(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face names -> gpt-fast's, q and k rows permuted from halves to interleaved pairs (its RoPE)."""

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
        return w.view(n_head, 2, args.head_dim // 2, args.dim).transpose(1, 2).reshape(args.head_dim * n_head, args.dim)

    out = {"tok_embeddings.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"],
           "output.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])}
    for i in range(args.n_layer):
        hf, gf = f"model.layers.{i}.", f"layers.{i}."
        out[gf + "attention.wqkv.weight"] = torch.cat([permute(state[hf + "self_attn.q_proj.weight"], args.n_head),
                                                       permute(state[hf + "self_attn.k_proj.weight"], args.n_local_heads),
                                                       state[hf + "self_attn.v_proj.weight"]])
        out[gf + "attention.wo.weight"] = state[hf + "self_attn.o_proj.weight"]
        out[gf + "feed_forward.w1.weight"] = state[hf + "mlp.gate_proj.weight"]
        out[gf + "feed_forward.w3.weight"] = state[hf + "mlp.up_proj.weight"]
        out[gf + "feed_forward.w2.weight"] = state[hf + "mlp.down_proj.weight"]
        out[gf + "attention_norm.weight"] = state[hf + "input_layernorm.weight"]
        out[gf + "ffn_norm.weight"] = state[hf + "post_attention_layernorm.weight"]
    return out


def build(spec: ModelSpec, state: dict[str, torch.Tensor], max_seq_len: int, device: torch.device,
          dtype: torch.dtype) -> Transformer:
    """gpt-fast's Transformer with our weights (as its generate.py loads one: on the meta device, then assigned)."""
    args = model_args(spec, max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(from_hf_state(state, args), assign=True)
    model = model.to(device=device, dtype=dtype)
    if spec.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def setup_caches(model: Transformer, batch: int, max_seq_len: int, device: torch.device) -> None:
    model.max_seq_length = -1  # gpt-fast keeps larger caches; a batch must match its cache's rows
    with torch.device(device):
        model.setup_caches(max_batch_size=batch, max_seq_length=max_seq_len)


def decode_logits(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    # x: [B, 1], input_pos: [1]
    return model(x, input_pos)


def time_batch(model: Transformer, batch: int, context: int, max_seq_len: int, compile_mode: str,
               iters: int, warmup: int) -> dict[str, Any]:
    device = model.tok_embeddings.weight.device
    torch._dynamo.reset()
    setup_caches(model, batch, max_seq_len, device)
    x = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    pos = torch.tensor([context], device=device)
    step = decode_logits if compile_mode == "none" else torch.compile(decode_logits, mode=compile_mode, fullgraph=True)

    def call() -> torch.Tensor:
        if compile_mode != "none":
            torch.compiler.cudagraph_mark_step_begin()
        return step(model, x, pos)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # as gpt-fast's decode_n_tokens
        t0 = time.perf_counter()
        for _ in range(3):  # compiles, then records the graphs
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
        samples = time_samples_ms(call, device, iters, warmup)
    return {"batch": batch, "ms": statistics.median(samples), "compile_s": compile_s, "samples_ms": samples}


def run(model: Any, batches: list[int], context: int, compile_mode: str, iters: int, warmup: int) -> dict[str, Any]:
    """Times gpt-fast's decode step at each batch on `model`'s shape, weights, device and dtype."""
    import torch._inductor.config as inductor

    max_seq_len = context + 64
    param = next(model.parameters())
    out: dict[str, Any] = {"source": SOURCE, "compile": compile_mode, "context": context, "max_seq_len": max_seq_len,
                           "timed": "model forward of one token per row (no sampling), median of the samples",
                           "rows": [], "errors": []}
    try:
        anchor = build(model.spec, model.state_dict(), max_seq_len, param.device, param.dtype)
    except Exception as exc:  # noqa: BLE001 - the anchor is context; the run goes on
        out["errors"].append(f"building gpt-fast's model: {type(exc).__name__}: {exc}")
        return out
    # gpt-fast's generate.py settings for its compiled decode
    with inductor.patch(coordinate_descent_tuning=True, fx_graph_cache=True):
        for batch in batches:
            try:
                out["rows"].append(time_batch(anchor, batch, context, max_seq_len, compile_mode, iters, warmup))
            except Exception as exc:  # noqa: BLE001 - recorded per batch
                out["errors"].append(f"batch {batch}: {type(exc).__name__}: {exc}"[:2000])
    del anchor
    torch._dynamo.reset()
    return out
