"""SamplingParams: how a prompt's completions are sampled and when each stops, the one vocabulary of
every way in (graphserve.v1, vLLM's engine protocol, the Python API) and of the engine.

A way in builds one from its own message; the values are checked here, when it is made, naming the
fields as that way's users spell them (`Fields`). What depends on the server (the context, the
vocabulary, the limits) is checked, and what the client left to the server (a seed, max_tokens) is
filled in, by validation.resolve when the request is made; the engine sees only resolved ones.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

MAX_LOGPROBS = 20  # top log-probabilities per token at most (the OpenAI API's limit)
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    """Structured output: the completion follows a JSON schema, any JSON object, a regex (the whole
    output), an EBNF grammar (GBNF with a `root` rule, or Lark) or one of a list of choices
    (service/engine/structured.py compiles it)."""

    kind: str  # one of CONSTRAINT_KINDS
    value: str | tuple[str, ...] = ""  # schema text, regex, grammar, or the choices ("" for json_object)

    def __post_init__(self) -> None:
        if isinstance(self.value, list):  # keep it hashable: it is the compiler's cache key
            object.__setattr__(self, "value", tuple(self.value))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's spelling of a Constraint (SamplingParams.structured_outputs): exactly one of json (a
    schema, as text or a dict), regex, choice, grammar, or json_object=True."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self, name: str) -> Constraint:
        given = {k: v for k, v in (("json_schema", self.json), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if v is not None}
        need(len(given) == 1, f"{name} needs exactly one of json, regex, choice, grammar, json_object=True; "
                              f"got {', '.join(given) or 'none'}")
        [(kind, value)] = given.items()
        if kind == "json_schema" and not isinstance(value, str):
            import json

            value = json.dumps(value)
        return Constraint(kind, "" if kind == "json_object" else value)


# vLLM's SamplingParams fields that graphserve cannot honour: taken at their default, else refused
# naming the field. field -> (default, why).
VLLM_REFUSED: dict[str, tuple[Any, str]] = {
    "skip_special_tokens": (True, "graphserve's text always skips special tokens (token_ids hold them)"),
    "bad_words": (None, "banning words is not supported; logit_bias bans single tokens (-100)"),
    "allowed_token_ids": (None, "restricting the vocabulary is not supported; use constraint/structured_outputs "
                                "(choice or regex) or logit_bias"),
    "logits_processors": (None, "graphserve samples on the device without per-request Python callbacks"),
    "extra_args": (None, "graphserve has no custom sampler plug-ins to pass them to"),
    "flat_logprobs": (False, "logprobs come as vLLM's list of {token id: Logprob} dicts"),
    "output_kind": (None, "generate() returns each prompt's output once, finished"),
    "skip_reading_prefix_cache": (None, "the prefix cache is skipped only by prompt_logprobs requests"),
}


MAX_SAMPLES = 16  # n: completions of one prompt per request
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| at most, as in the OpenAI API
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most, as in the OpenAI API
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS). Sampling at a temperature t -> 0 tends
# to argmax, which greedy computes exactly; dividing the logits by a tiny t does not: 1e-45 makes
# them +-inf in float32 and the sampler picks the first infinite one, a degenerate stream. Mapped,
# not refused: OpenAI-style clients send tiny temperatures to mean "deterministic".
GREEDY_TEMPERATURE_EPSILON = 1e-5


class InvalidRequest(ValueError):
    """Bad input from the client: becomes INVALID_ARGUMENT with this message."""


@dataclass(frozen=True)
class Fields:
    """How one way in names the values it checks (for the messages)."""

    sampling: str  # prefix of the sampling fields: "sampling." -> "sampling.temperature"
    stopping: str  # prefix of the stopping fields
    prompt_ids: str  # the prompt's token ids
    max_seq_len: str  # the setting that bounds the context
    n: str = "n"  # the number of samples


GRAPHSERVE_FIELDS = Fields("sampling.", "stopping.", "prompt.token_ids", "--max-seq-len")
PYTHON_FIELDS = Fields("SamplingParams.", "SamplingParams.", "prompt", "max_seq_len", "SamplingParams.n")


def need(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (below 1e-5 too). top_k 0 (or -1) and top_p 1 disable those filters.
    The same seed, prompt and parameters give the same tokens whatever else shares the batch; seed
    None draws one. max_tokens None is the server's default, capped by the room the context leaves.
    Generation stops before a `stop` string (not included in the text) and after a token of
    `stop_token_ids` or the model's end-of-sequence token (unless ignore_eos).

    As in vLLM: min_p drops tokens below min_p x the top token's probability; presence_penalty and
    frequency_penalty (OpenAI's, in [-2, 2]) lower the logits of tokens the completion holds (once, and
    per occurrence); repetition_penalty (transformers', > 0, 1 is off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the completion; min_tokens keeps EOS,
    the stop token ids and the stop strings from ending the completion earlier; logit_bias adds a
    value in [-100, 100] to a token's logit. logprobs: the log-probability of each completion token and
    of the `logprobs` most likely ones (0 to 20), the model's own (before the processing above);
    prompt_logprobs: the same for each prompt token after the first (such a prompt takes nothing
    from the prefix cache). constraint: the completion follows a JSON schema, any JSON object, a
    regex, an EBNF grammar or one of a list of choices, and ends when the grammar is complete.
    n: independent completions of the prompt (1 to 16), completion i sampled with seed + i; they share
    the prompt's prefill through the prefix cache.

    vLLM's own fields: those the Python API honours (include_stop_str_in_output, detokenize,
    truncate_prompt_tokens, structured_outputs, spaces_between_special_tokens) and those refused unless
    at their default (VLLM_REFUSED: skip_special_tokens=False, bad_words, ...), naming the field.

    `fields` (not kept) names the values in error messages: the Python API's names by default.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()  # a string or any sequence of them is taken
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by id; a mapping is taken
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    # vLLM's names, honoured by the Python API's output (the engine never reads them):
    include_stop_str_in_output: bool = False  # the stop string that ended a completion ends its text
    detokenize: bool = True  # False: text "" (token ids only); no stop strings then
    spaces_between_special_tokens: bool = True  # no effect: special tokens are never in the text
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's spelling of constraint
    # vLLM's, refused unless at their default (VLLM_REFUSED):
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logits_processors: list[Any] | None = None
    extra_args: dict[str, Any] | None = None
    flat_logprobs: bool = False
    output_kind: Any = None
    skip_reading_prefix_cache: bool | None = None
    fields: InitVar[Fields | None] = None

    def __post_init__(self, fields: Fields | None) -> None:
        f = fields or PYTHON_FIELDS
        _refuse_vllm_only(self, f)
        _normalise(self, f)
        _check(self, f)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property  # the fields are frozen; the engine asks per row per step
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy and nothing else that changes the logits or asks for more than the token (a grammar
        aside: its mask applies either way): such a row samples the argmax."""
        return (self.temperature == 0.0 and not self.logit_bias and not self.penalized and self.logprobs is None
                and self.min_tokens == 0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _refuse_vllm_only(p: SamplingParams, f: Fields) -> None:
    """vLLM's fields: the refused ones at their default, the rest of the right type, structured_outputs
    made the constraint."""
    s = f.sampling
    for name, (default, why) in VLLM_REFUSED.items():
        value = getattr(p, name)
        need(value == default or (default is None and not value),
             f"{s}{name}={value!r} is not supported by graphserve: {why}")
    for name in ("include_stop_str_in_output", "detokenize", "spaces_between_special_tokens"):
        need(isinstance(getattr(p, name), bool), f"{s}{name} must be True or False, got {getattr(p, name)!r}")
    k = p.truncate_prompt_tokens
    need(k is None or (_is_int(k) and (k >= 1 or k == -1)),
         f"{s}truncate_prompt_tokens must be None, an int >= 1 or -1 (max_model_len), got {k!r}")
    need(p.detokenize or not p.stop, f"{f.stopping}stop needs detokenize=True (stop strings are matched in the text)")
    if p.structured_outputs is not None:
        need(isinstance(p.structured_outputs, StructuredOutputsParams),
             f"{s}structured_outputs must be None or a StructuredOutputsParams, got {p.structured_outputs!r}")
        constraint = p.structured_outputs.constraint(f"{s}structured_outputs")
        need(p.constraint in (None, constraint),  # equal: a copy (dataclasses.replace) of one made so
             f"{s}structured_outputs and {s}constraint say the same thing: give one of them")
        object.__setattr__(p, "constraint", constraint)


def _normalise(p: SamplingParams, f: Fields) -> None:
    """Python types checked and put in their one form (a Python caller may pass a str for stop, a
    dict for logit_bias, -1 for top_k); a wrong type is InvalidRequest naming the field."""
    s = f.sampling
    need(_is_number(p.temperature), f"{s}temperature must be a finite number >= 0 (0 is greedy), got {p.temperature!r}")
    need(_is_number(p.top_p), f"{s}top_p must be in (0, 1], got {p.top_p!r}")
    need(_is_int(p.top_k) and p.top_k >= -1, f"{s}top_k must be an int >= 0 (0 or -1: off), got {p.top_k!r}")
    need(p.seed is None or _is_int(p.seed), f"{s}seed must be None or an int in [0, 2**64), got {p.seed!r}")
    need(p.max_tokens is None or (_is_int(p.max_tokens) and p.max_tokens >= 1),
         f"{f.stopping}max_tokens must be None or an int >= 1, got {p.max_tokens!r}")
    stop = (p.stop,) if isinstance(p.stop, str) else tuple(p.stop or ())
    need(all(isinstance(x, str) for x in stop), f"{f.stopping}stop must hold strings, got {p.stop!r}")
    need(isinstance(p.ignore_eos, bool), f"{f.stopping}ignore_eos must be True or False, got {p.ignore_eos!r}")
    ids = tuple(p.stop_token_ids or ())
    need(all(_is_int(i) and i >= 0 for i in ids), f"{f.stopping}stop_token_ids must hold token ids >= 0, got {ids!r}")
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        need(_is_number(getattr(p, name)), f"{s}{name} must be a number, got {getattr(p, name)!r}")
    need(_is_int(p.min_tokens), f"{f.stopping}min_tokens must be an int >= 0, got {p.min_tokens!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        need(value is None or _is_int(value), f"{s}{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
    pairs = p.logit_bias.items() if isinstance(p.logit_bias, Mapping) else tuple(p.logit_bias or ())
    pairs = tuple(pairs)
    need(all(isinstance(x, Sequence) and len(x) == 2 and _is_int(x[0]) and _is_number(x[1]) for x in pairs),
         f"{s}logit_bias must map token ids to numbers, got {p.logit_bias!r}")
    need(p.constraint is None or isinstance(p.constraint, Constraint),
         f"{s}constraint must be None or a Constraint, got {p.constraint!r}")
    need(_is_int(p.n), f"{f.n} must be an int in [1, {MAX_SAMPLES}], got {p.n!r}")
    for name, value in (("top_k", max(0, p.top_k)), ("stop", stop), ("stop_token_ids", ids),
                        ("logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs))),
                        ("temperature", float(p.temperature)), ("top_p", float(p.top_p))):
        object.__setattr__(p, name, value)


def _check(p: SamplingParams, f: Fields) -> None:
    """The values' ranges, which do not depend on the server."""
    s = f.sampling
    need(math.isfinite(p.temperature) and p.temperature >= 0,
         f"{s}temperature must be a finite number >= 0 (below {GREEDY_TEMPERATURE_EPSILON:g} is greedy), "
         f"got {p.temperature}")
    need(math.isfinite(p.top_p) and 0 < p.top_p <= 1, f"{s}top_p must be in (0, 1], got {p.top_p}")
    need(p.seed is None or 0 <= p.seed < 2**64, f"{s}seed must be in [0, 2**64), got {p.seed}")
    need(math.isfinite(p.min_p) and 0 <= p.min_p <= 1, f"{s}min_p must be in [0, 1] (0 is off), got {p.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        need(math.isfinite(value) and abs(value) <= MAX_PENALTY,
             f"{s}{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 is off), got {value}")
    need(math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0,
         f"{s}repetition_penalty must be a finite number > 0 (1 is off), got {p.repetition_penalty}")
    need(p.min_tokens >= 0, f"{f.stopping}min_tokens must be >= 0, got {p.min_tokens}")
    need(all(p.stop), f"{f.stopping}stop contains an empty string")
    need(p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
         f"{s}logprobs must be in [0, {MAX_LOGPROBS}] (the top tokens reported per position), got {p.logprobs}")
    need(p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
         f"{s}prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the top tokens reported per prompt "
         f"position; the whole vocabulary, -1, is not served), got {p.prompt_logprobs}")
    need(len(p.logit_bias) <= MAX_LOGIT_BIAS,
         f"{s}logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token, bias in p.logit_bias:
        need(math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS_VALUE,
             f"{s}logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}")
    need(1 <= p.n <= MAX_SAMPLES, f"{f.n} must be in [1, {MAX_SAMPLES}], got {p.n}")
