"""One request's state inside the engine, each piece with one writer: the scheduler (status, row,
prefill progress), the KV manager (blocks, prefix hashes, computed positions, preemptions) and the
engine's read path (tokens, what is in flight, the grammar's position)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from service.engine.request import GenerationRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity semantics: two sequences are never "equal", and they stay hashable
class Sequence:
    request: GenerationRequest
    # The engine's name for this sequence: unique per submit, unlike the client's request id.
    key: str = ""

    # ---- the scheduler's (service/engine/scheduler.py) ----
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None  # its row (of a step, of the block table), held only while RUNNING
    aborted: bool = False
    scheduled_at: float | None = None  # time.monotonic() when first admitted (prefill)
    # Back-pressure: its client has not read what was generated; it keeps its slot but is not scheduled.
    paused: bool = False
    # Tokens to prefill before decoding: the prompt; after a preemption, every token known so far
    # (the KV is recomputed). Set at each admission.
    prefill_len: int = 0
    # Of those, the tokens scheduled by steps launched so far: the prefill's progress. A prompt
    # longer than a step's token budget is prefilled in chunks over several steps.
    num_prefilled_tokens: int = 0
    # The device slot of the request's LoRA adapter while it runs (0: the base model).
    lora_slot: int = 0
    # Adapter requests admitted ahead of it while it waited for an adapter slot (see Scheduler).
    num_passed: int = 0
    admitted: int = 0  # admission order (the scheduler's counter): the newest running is preempted first
    # Speculative decoding: the moving average of its drafts' per-token acceptance (spec/adaptive.py;
    # None: no draft verified yet).
    draft_acceptance: float | None = None

    # ---- the KV manager's (service/engine/kv_manager.py) ----
    # The blocks holding positions [0, len * block_size) while RUNNING; the chained hashes of its
    # full blocks (kept while it waits after a preemption), and how many of block_ids it offered to
    # the prefix cache.
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # KV positions [0, n) scheduled by steps launched so far (the prefill's progress, then each decode).
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    num_preemptions: int = 0

    # ---- the engine's read path (service/engine/engine.py, output.py) ----
    completion_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled on the device by a step still in flight (0 or 1): the engine launches step t+1
    # before it reads step t's tokens, so positions and sampling counters count them already.
    num_pending: int = 0
    first_token_at: float | None = None  # time.monotonic() when the first completion token was read
    # Structured output: the request's position in its grammar (service/engine/structured.Matcher),
    # advanced by each token the engine reads; the sampler masks the tokens it does not allow.
    matcher: Any = None

    def __post_init__(self) -> None:
        if not self.key:
            self.key = self.request.request_id
        if not self.prefill_len:
            self.prefill_len = self.num_prompt_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_completion_tokens

    @property
    def num_unprefilled_tokens(self) -> int:
        return self.prefill_len - self.num_prefilled_tokens if self.status is SequenceStatus.RUNNING else 0

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end): the prompt, then the completion."""
        p = self.request.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        return (p + self.completion_token_ids)[start:end]

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked and not out yet (they go with the first token): every prompt token's
        logits are computed, so the prompt takes nothing from the prefix cache (a preemption before
        the first token recomputes them)."""
        return self.request.sampling.prompt_logprobs is not None and self.first_token_at is None

    @property
    def exhausted(self) -> bool:
        """Every token max_tokens allows is sampled (some may still be in flight): no more decodes."""
        return self.num_completion_tokens + self.num_pending >= self.request.sampling.max_tokens

    def last_token_id(self) -> int:
        """The input of the next decode step: the newest token, generated or (before any) prompt.
        Only meaningful with no token pending (the runner takes a pending one from the device)."""
        if self.completion_token_ids:
            return self.completion_token_ids[-1]
        return self.request.prompt_token_ids[-1]

    def next_position(self) -> int:
        """Position of the next decode step's input token (0-based), i.e. where its KV entry is
        written; a pending token counts."""
        return self.num_tokens + self.num_pending - 1
