"""A separate draft model (method draft_model, vLLM's spelling): a second, smaller checkpoint that
shares the target's tokenizer, loaded by the same engine process on the target's device and dtype,
drafts greedily through the same code path as draft_layers (LlamaForCausalLM.draft_greedy, here
with all of the draft's layers) in the recompute-window form of draft_layers.py: no paged KV and no
graphs of its own yet, so nothing to roll back, preempt or prefix-cache.

The draft must share the target's tokenizer: its vocab_size (config.json) is checked before its
weights are read, its tokenizer's vocabulary (every token and id) once it is loaded; a mismatch
fails at start naming the field `model`.
"""

from __future__ import annotations

import pathlib

import structlog

from service.config import SpeculativeConfig
from service.engine.spec.draft_layers import GreedyDraftProposer
from service.model.loader import LoadedModel, load_model, read_model_spec
from service.model.spec import ModelLoadError

log = structlog.get_logger("graphserve.spec")


def vocab_problem(draft: str, draft_vocab: int, target: str, target_vocab: int) -> str | None:
    """Why the draft's vocab_size cannot serve the target's, or None."""
    if draft_vocab == target_vocab:
        return None
    return (f"speculative_config.model {draft}: the draft's vocab_size {draft_vocab} is not the target "
            f"{target}'s {target_vocab}: a draft model must share the target's tokenizer")


def load_draft_model(config: SpeculativeConfig, target: LoadedModel, cache_dir: pathlib.Path | None = None,
                     batch_invariant: bool = False) -> LoadedModel:
    """config.model loaded as the target was (device, dtype), after its vocabulary is checked against
    the target's. ValueError naming speculative_config.model when it cannot draft for the target."""
    name = config.model
    assert name is not None  # SpeculativeConfig.validate: draft_model has one
    try:
        spec = read_model_spec(name, cache_dir)
        problem = vocab_problem(name, spec.vocab_size, target.name, target.spec.vocab_size)
        if problem is not None:
            raise ValueError(problem)
        draft = load_model(name, target.device, target.dtype, cache_dir, batch_invariant=batch_invariant)
    except ModelLoadError as exc:
        raise ValueError(f"speculative_config.model {name}: {exc}") from None
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculative_config.model {name}: its tokenizer's vocabulary differs from the target "
                         f"{target.name}'s (same size, other tokens or ids): a draft model must share the "
                         "target's tokenizer")
    log.info("draft_model_loaded", model=name, layers=draft.spec.num_layers, gib=round(sum(
        p.numel() * p.element_size() for p in draft.model.parameters()) / 2**30, 3))
    return draft


class DraftModelProposer(GreedyDraftProposer):
    """Greedy drafts of the whole draft model (load_draft_model) over the row's recent tokens."""

    def __init__(self, draft: LoadedModel) -> None:
        super().__init__(draft.model, draft.device, None)
        self.draft = draft
