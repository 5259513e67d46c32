"""Self-speculative drafting (as LayerSkip): the target model's own first num_draft_layers layers,
then its final norm and LM head, guess a row's next k tokens greedily. No second checkpoint, no
second tokenizer: the draft shares the target's weights, so it costs no memory beyond activations.

The recompute-window form: each proposal runs the draft over the row's last WINDOW tokens (at their
true positions), then one pass per draft token, with K/V that live for that proposal only
(LlamaForCausalLM.draft_greedy); the draft keeps no paged KV of its own between steps, so nothing
needs rolling back, preempting or prefix-caching. The cost per proposal is one pass of the draft's
layers over the window plus k one-token passes, run eagerly on the engine thread (the only thread
that touches the device). Output never depends on the draft: the target verifies every token.
"""

from __future__ import annotations

import torch

from service.config import SpeculativeConfig
from service.engine.sequence import Sequence

# The tokens a proposal's first pass reads: the draft attends to no token before them.
WINDOW = 256


def check_draft_layers(config: SpeculativeConfig, num_layers: int) -> None:
    """ValueError naming the field when the model cannot draft with config's layers."""
    n = config.num_draft_layers
    if n is None or not 1 <= n < num_layers:
        raise ValueError(f"speculative_config.num_draft_layers must be in [1, {num_layers - 1}] (fewer than the "
                         f"model's {num_layers} layers), got {n!r}")


class GreedyDraftProposer:
    """Greedy drafts of `model` (the target itself cut after num_layers layers, or a separate draft
    model whole: num_layers None) over the row's last WINDOW tokens, the recompute-window form above."""

    def __init__(self, model: torch.nn.Module, device: torch.device, num_layers: int | None) -> None:
        self.model, self.device, self.num_layers = model, device, num_layers

    def propose(self, seq: Sequence, k: int) -> list[int]:
        end = seq.num_tokens
        start = max(0, end - WINDOW)
        ids = torch.tensor(seq.token_ids(start, end), dtype=torch.long, device=self.device)
        return self.model.draft_greedy(ids, start, self.num_layers, k).tolist()

    def finished(self, seq: Sequence) -> None:
        pass


class DraftLayersProposer(GreedyDraftProposer):
    def __init__(self, config: SpeculativeConfig, model: torch.nn.Module, device: torch.device) -> None:
        check_draft_layers(config, model.spec.num_layers)
        super().__init__(model, device, config.num_draft_layers)
