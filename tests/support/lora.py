"""PEFT adapters made at test time on the built-in model, and peft's greedy tokens as the reference."""

from __future__ import annotations

import pathlib

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(model_dir: pathlib.Path):  # noqa: ANN201 - a transformers model
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def make_adapter(model_dir: pathlib.Path, out: pathlib.Path, seed: int, r: int = 8, alpha: int = 16,
                 targets: list[str] | str | None = None, use_rslora: bool = False, scale_b: float = 1.0) -> pathlib.Path:
    """A PEFT LoRA adapter of the model in model_dir with random non-zero A and B (fixed seed), saved to out."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, init_lora_weights=False,
                             use_rslora=use_rslora, lora_dropout=0.0)
    model = peft.get_peft_model(hf_model(model_dir), config)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    model.save_pretrained(out)
    return out


def peft_greedy(model_dir: pathlib.Path, adapter_dir: pathlib.Path | None, prompt_ids: list[int],
                max_tokens: int) -> list[int]:
    """peft's (or, without an adapter, transformers') greedy completion tokens, float32 on CPU, EOS not special."""
    import peft

    model = hf_model(model_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():  # a plain greedy loop: generate()'s min_new_tokens would mask EOS, ignore_eos does not
        for _ in range(max_tokens):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
