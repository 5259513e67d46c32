"""What the Python API's `generate` and `chat` return, shaped as vLLM's (`vllm.outputs`,
`vllm.logprobs`): a RequestOutput per prompt holding a CompletionOutput per sample, and per token a
{token id: Logprob} dict, so that code written for vLLM reads them unchanged.

graphserve adds to vLLM's fields only what it alone knows: each sample's `seed` and `timings`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.engine.request import FinishReason, TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability at one position (vLLM's): its rank in the vocabulary (1 is the most
    likely) and its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per completion token: the sampled token and the top `logprobs` tokens there, by token id.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first, then as SampleLogprobs for the prompt's own tokens.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class Timings:
    queue_seconds: float  # from submit to the first scheduling step
    time_to_first_token_seconds: float
    total_seconds: float


@dataclass
class CompletionOutput:
    """One of a prompt's n samples (SamplingParams.n), as vLLM's."""

    index: int  # 0 to n - 1
    text: str  # without the stop string unless include_stop_str_in_output; "" when detokenize=False
    token_ids: list[int]  # a stop token or EOS that ended it is not included
    cumulative_logprob: float | None  # the sum of token_ids' log-probabilities; None without logprobs
    logprobs: SampleLogprobs | None  # one dict per token of token_ids when SamplingParams.logprobs asked
    finish_reason: str | None = None  # "stop" (EOS, a stop string or stop token id, a complete grammar),
    # "length" (max_tokens or the context) or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS)
    seed: int = 0  # graphserve's: the seed that drove sampling, the first sample's + index
    timings: Timings | None = None  # graphserve's

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's samples, as vLLM's. `generate` returns them finished, in prompt order."""

    request_id: str
    prompt: str | None  # the text (for chat: as the template rendered it); None for token ids
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None  # when SamplingParams.prompt_logprobs asked
    outputs: list[CompletionOutput]  # all n, in index order
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (by the first sample)


def finish_reason(reason: FinishReason) -> str:
    """vLLM's name: the end-of-sequence token is a "stop" too (stop_reason None tells it apart)."""
    return "stop" if reason is FinishReason.EOS else reason.value


def logprob_dicts(token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  decode: Callable[[int], str | None]) -> SampleLogprobs:
    """vLLM's shape of the engine's logprobs: per position the chosen token (its own rank), then the
    top tokens (ranks 1, 2, ...) unless one is the chosen token."""
    out = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        entry = {token: Logprob(lp.logprob, lp.rank, decode(token))}
        for rank, (top_id, value) in enumerate(lp.top, start=1):
            if top_id != token:
                entry[top_id] = Logprob(value, rank, decode(top_id))
        out.append(entry)
    return out
