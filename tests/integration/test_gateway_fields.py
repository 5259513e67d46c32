"""Every OpenAI request field of README's gateway table, one test each, through the real smg and the
official openai client: honoured (the field changes what comes back, as graphserve.v1 does), ignored
by smg (what comes back equals the answer without it: smg 1.13.0 does not forward it to its gRPC
workers), or rejected (HTTP 400 naming it). A row whose behaviour changes (a new smg forwards a
field) fails here, and README's table is updated with it. The request shapes of lm-eval's
local-completions and of guidellm's OpenAI backend are rows too."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from service.proto import inference_pb2 as pb
from tests.integration.test_gateway import (
    MODEL,
    assert_same_text,
    client,
    graphserve_text,
    replicas_behind_smg,
    tokenizer,
)
from tests.support.gateway import find_smg

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

README = Path(__file__).resolve().parents[2] / "README.md"
MESSAGES = [{"role": "user", "content": "Tell me about graphs"}]
PROMPT = "The graph cache"


@dataclass
class Fleet:
    oa: openai.OpenAI
    replica: object  # ServerProcess

    def chat(self, **fields: object) -> object:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **fields}
        extra = {k: body.pop(k) for k in list(body) if k not in CHAT_PARAMS}
        return self.oa.chat.completions.create(**body, extra_body=extra or None)

    def text(self, **fields: object) -> object:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
        extra = {k: body.pop(k) for k in list(body) if k not in TEXT_PARAMS}
        return self.oa.completions.create(**body, extra_body=extra or None)

    def prompt_ids(self, prompt: str = PROMPT) -> list[int]:
        return tokenizer(self.replica).encode(prompt, add_special_tokens=False)  # as smg tokenizes a prompt


CHAT_PARAMS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
               "stream_options", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
               "top_logprobs", "seed", "response_format", "tools", "tool_choice", "user"}
TEXT_PARAMS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
               "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "seed", "echo", "suffix",
               "best_of", "user"}


@pytest.fixture(scope="module")
def fleet(model_cache_dir, tmp_path_factory) -> Iterator[Fleet]:  # noqa: ANN001
    with replicas_behind_smg(1, model_cache_dir, tmp_path_factory.mktemp("fields"), "fields") as ([replica], gateway):
        yield Fleet(client(gateway), replica)


def content(answer: object) -> str:
    return answer.choices[0].message.content


def greedy_ids(fleet: Fleet, count: int) -> list[int]:
    """graphserve.v1's greedy completion ids of PROMPT, tokenized as smg does."""
    from tests.integration.test_gateway import v1_stub
    from tests.support.server import generate

    chunks, _ = generate(v1_stub(fleet.replica), token_ids=pb.TokenIds(ids=fleet.prompt_ids()),
                         sampling=pb.SamplingParams(temperature=0),
                         stopping=pb.StoppingCriteria(max_tokens=count, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids]


def rejected(call: Callable[[], object], *names: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert any(name in str(info.value) for name in names), str(info.value)


# ---- honoured --------------------------------------------------------------------------------------


def row_max_tokens(f: Fleet) -> None:
    assert f.text(max_tokens=5, ignore_eos=True).usage.completion_tokens == 5
    assert f.chat(max_tokens=5, ignore_eos=True).usage.completion_tokens == 5


def row_max_completion_tokens(f: Fleet) -> None:
    assert f.chat(max_tokens=None, max_completion_tokens=6, ignore_eos=True).usage.completion_tokens == 6


def row_temperature_and_seed(f: Fleet) -> None:
    expected, _ = graphserve_text(f.replica, 8, token_ids=pb.TokenIds(ids=f.prompt_ids()))
    assert_same_text(f.text().choices[0].text, expected)  # temperature 0: graphserve.v1's greedy text
    first = f.text(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True).choices[0].text
    assert f.text(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True).choices[0].text == first
    assert any(f.text(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True).choices[0].text != first for s in (12, 13))


def row_top_p(f: Fleet) -> None:
    assert f.text(temperature=1.0, top_p=1e-6, seed=3).choices[0].text == f.text().choices[0].text


def row_top_k(f: Fleet) -> None:
    assert f.text(temperature=1.0, top_k=1, seed=3).choices[0].text == f.text().choices[0].text


def row_min_p(f: Fleet) -> None:
    assert f.text(temperature=1.0, min_p=1.0, seed=3).choices[0].text == f.text().choices[0].text


def row_stop(f: Fleet) -> None:
    text = f.text(max_tokens=16, ignore_eos=True).choices[0].text
    visible = [ch for ch in text[1:] if ch.isalnum()]
    assert visible, text
    stopped = f.text(max_tokens=16, ignore_eos=True, stop=[visible[0]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(visible[0], 1)]


def row_stop_token_ids(f: Fleet) -> None:
    ids = greedy_ids(f, 6)
    answer = f.text(max_tokens=6, ignore_eos=True, stop_token_ids=[ids[2]])
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == ids.index(ids[2]) + 1


def row_ignore_eos(f: Fleet) -> None:
    assert f.text(max_tokens=40, ignore_eos=True).usage.completion_tokens == 40


def row_penalties(f: Fleet) -> None:
    plain = f.text(max_tokens=16, ignore_eos=True).choices[0].text
    penalized = [f.text(max_tokens=16, ignore_eos=True, **{k: v}).choices[0].text
                 for k, v in (("presence_penalty", 2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 2.0))]
    assert all(p != plain for p in penalized), (plain, penalized)


def row_chat_logprobs(f: Fleet) -> None:
    content_lps = f.chat(logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert content_lps and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in content_lps)


def row_n(f: Fleet) -> None:
    assert sorted(c.index for c in f.chat(n=3, temperature=1.0, seed=5).choices) == [0, 1, 2]
    assert len(f.text(n=12, temperature=1.0, seed=5).choices) == 12  # completions: up to graphserve's 16


def row_response_format(f: Fleet) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    answer = f.chat(max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert answer.choices[0].finish_reason == "stop" and json.loads(content(answer)).keys() == {"ok"}
    answer = f.chat(max_tokens=400, temperature=1.0, seed=1, response_format={"type": "json_object"})
    assert answer.choices[0].finish_reason == "stop" and isinstance(json.loads(content(answer)), dict)
    assert content(f.chat(response_format={"type": "text"})) == content(f.chat())


def row_smg_constraints(f: Fleet) -> None:
    assert re.fullmatch(r"yes|no", f.text(regex="(yes|no)").choices[0].text)
    assert f.chat(ebnf='root ::= "yes" | "no"').choices[0].message.content in ("yes", "no")
    assert json.loads(f.text(json_schema='{"type": "boolean"}', max_tokens=10).choices[0].text) in (True, False)


def row_stream_usage(f: Fleet) -> None:
    chunks = list(f.oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5


def row_echo(f: Fleet) -> None:
    assert f.text(echo=True).choices[0].text == PROMPT + f.text().choices[0].text


def row_suffix(f: Fleet) -> None:
    assert f.text(suffix=" THE END").choices[0].text == f.text().choices[0].text + " THE END"


def row_prompt_list(f: Fleet) -> None:
    answer = f.text(prompt=[PROMPT, "Another prompt"])
    assert [c.index for c in answer.choices] == [0, 1] and answer.choices[0].text == f.text().choices[0].text


def row_tools(f: Fleet) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    assert f.chat(tools=tools, tool_choice="auto").usage.completion_tokens == 8


# ---- ignored by smg (answers equal those without the field) ----------------------------------------


def row_logit_bias(f: Fleet) -> None:
    forced = greedy_ids(f, 1)[0] + 1
    assert f.text(logit_bias={str(forced): 100}).choices[0].text == f.text().choices[0].text


def row_min_tokens(f: Fleet) -> None:
    from tests.integration.test_gateway import v1_stub
    from tests.support.server import generate

    first = greedy_ids(f, 1)[0]
    assert f.text(stop_token_ids=[first]).usage.completion_tokens == 1
    answer = f.text(min_tokens=4, stop_token_ids=[first])
    chunks, _ = generate(v1_stub(f.replica), token_ids=pb.TokenIds(ids=f.prompt_ids()),
                         sampling=pb.SamplingParams(temperature=0),
                         stopping=pb.StoppingCriteria(max_tokens=8, min_tokens=4, stop_token_ids=[first]))
    assert answer.usage.completion_tokens == sum(len(c.token_ids) for c in chunks) >= 4
    assert_same_text(answer.choices[0].text, "".join(c.text for c in chunks))


def row_vllm_structured_outputs(f: Fleet) -> None:
    plain = f.chat().choices[0].message.content
    for fields in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]},
                   {"guided_regex": "(yes|no)"}, {"guided_json": {"type": "boolean"}},
                   {"guided_grammar": 'root ::= "yes"'}):
        assert content(f.chat(**fields)) == plain, fields


def row_include_stop_str_in_output(f: Fleet) -> None:
    text = f.text(max_tokens=16, ignore_eos=True).choices[0].text
    stop = next(ch for ch in text[1:] if ch.isalnum())
    kept = f.text(max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True).choices[0].text
    assert not kept.endswith(stop)


def row_prompt_logprobs(f: Fleet) -> None:
    assert "prompt_logprobs" not in f.text(prompt_logprobs=1).model_dump_json(exclude_none=True)


def row_return_token_ids(f: Fleet) -> None:
    dumped = f.chat(return_token_ids=True).model_dump(exclude_none=True)
    assert "token_ids" not in json.dumps(dumped)


def row_completion_logprobs(f: Fleet) -> None:
    assert f.text(logprobs=2).choices[0].logprobs is None


def row_best_of(f: Fleet) -> None:
    answer = f.text(best_of=3, temperature=1.0, seed=2)
    assert len(answer.choices) == 1 and answer.choices[0].text == f.text(temperature=1.0, seed=2).choices[0].text


def row_truncate_prompt_tokens(f: Fleet) -> None:
    assert f.text(truncate_prompt_tokens=2).usage.prompt_tokens == len(f.prompt_ids())


def row_user_and_unknown_fields(f: Fleet) -> None:
    plain = content(f.chat())
    assert content(f.chat(user="someone")) == plain and content(f.chat(no_such_field=1)) == plain


# ---- rejected ------------------------------------------------------------------------------------


def row_n_over_10_chat(f: Fleet) -> None:
    rejected(lambda: f.chat(n=11), "n")


def row_stop_over_4(f: Fleet) -> None:
    rejected(lambda: f.text(stop=["a", "b", "c", "d", "e"]), "stop")
    rejected(lambda: f.chat(stop=["a", "b", "c", "d", "e"]), "stop")


def row_token_id_prompt(f: Fleet) -> None:
    rejected(lambda: f.text(prompt=f.prompt_ids()), "prompt")


def row_out_of_range(f: Fleet) -> None:
    rejected(lambda: f.text(max_tokens=10**6), "max_tokens")
    rejected(lambda: f.chat(top_k=-5), "top_k")


# ---- what lm-eval and guidellm send ----------------------------------------------------------------


def row_lm_eval_generate(f: Fleet) -> None:
    """lm-eval 0.4.13 local-completions, generate_until, tokenized_requests=False: a list of prompts,
    `until` plus the EOS text as stop (a task with 4 `until` strings and the EOS is over smg's cap)."""
    body = {"model": MODEL, "prompt": [PROMPT], "max_tokens": 16, "temperature": 0, "stop": ["\n\n", "Question:", "</s>"],
            "seed": 1234}
    answer = f.oa.completions.create(**body)
    assert [c.index for c in answer.choices] == [0] and isinstance(answer.choices[0].text, str)
    rejected(lambda: f.oa.completions.create(**{**body, "stop": ["\n\n", "Q:", "A:", "###", "</s>"]}), "stop")


def row_lm_eval_loglikelihood(f: Fleet) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1): no logprobs come back, so its
    loglikelihood tasks fail (KeyError in lm-eval); generation tasks work."""
    answer = f.oa.completions.create(model=MODEL, prompt=[PROMPT], temperature=0, max_tokens=1, logprobs=1, seed=1234,
                                     echo=True)
    assert answer.choices[0].logprobs is None


def row_guidellm(f: Fleet) -> None:
    """guidellm 0.8.1's OpenAI backend: streamed, usage in every chunk asked, stop null, ignore_eos."""
    stream = f.oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True, stop=None,
                                     stream_options={"include_usage": True, "continuous_usage_stats": True},
                                     extra_body={"ignore_eos": True})
    assert [c.usage for c in stream if c.usage][-1].completion_tokens == 12
    stream = f.oa.chat.completions.create(model=MODEL, max_completion_tokens=12, stream=True, stop=None,
                                          messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
                                          stream_options={"include_usage": True, "continuous_usage_stats": True},
                                          extra_body={"ignore_eos": True})
    assert [c.usage for c in stream if c.usage][-1].completion_tokens == 12


# (README's "field" cell, endpoints, status, the test)
ROWS: list[tuple[str, str, str, Callable[[Fleet], None]]] = [
    ("`max_tokens`", "both", "honoured", row_max_tokens),
    ("`max_completion_tokens`", "chat", "honoured", row_max_completion_tokens),
    ("`temperature`, `seed`", "both", "honoured", row_temperature_and_seed),
    ("`top_p`", "both", "honoured", row_top_p),
    ("`top_k` (extra)", "both", "honoured", row_top_k),
    ("`min_p` (extra)", "both", "honoured", row_min_p),
    ("`stop` (at most 4)", "both", "honoured", row_stop),
    ("`stop_token_ids` (extra)", "both", "honoured", row_stop_token_ids),
    ("`ignore_eos` (extra)", "both", "honoured", row_ignore_eos),
    ("`min_tokens` (extra)", "completions", "honoured", row_min_tokens),
    ("`presence_penalty`, `frequency_penalty`, `repetition_penalty` (extra)", "both", "honoured", row_penalties),
    ("`logprobs`, `top_logprobs`", "chat", "honoured", row_chat_logprobs),
    ("`n` (chat at most 10)", "both", "honoured", row_n),
    ("`response_format` (`json_schema`, `json_object`, `text`)", "chat", "honoured", row_response_format),
    ("`regex`, `ebnf`, `json_schema` (smg's extras)", "both", "honoured", row_smg_constraints),
    ("`stream`, `stream_options.include_usage`", "both", "honoured", row_stream_usage),
    ("`echo`", "completions", "honoured by smg", row_echo),
    ("`suffix`", "completions", "honoured by smg", row_suffix),
    ("`prompt` as a list of strings", "completions", "honoured", row_prompt_list),
    ("`tools`, `tool_choice`", "chat", "honoured by smg", row_tools),
    ("`logit_bias`", "both", "ignored by smg", row_logit_bias),
    ("`structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's extras)",
     "both", "ignored by smg", row_vllm_structured_outputs),
    ("`include_stop_str_in_output` (extra)", "both", "ignored by smg", row_include_stop_str_in_output),
    ("`prompt_logprobs` (extra)", "both", "ignored by smg", row_prompt_logprobs),
    ("`return_token_ids` (extra)", "both", "ignored by smg", row_return_token_ids),
    ("`logprobs`", "completions", "ignored by smg", row_completion_logprobs),
    ("`best_of`", "completions", "ignored by smg", row_best_of),
    ("`truncate_prompt_tokens` (extra)", "both", "ignored by smg", row_truncate_prompt_tokens),
    ("`user`, unknown fields", "both", "ignored by smg", row_user_and_unknown_fields),
    ("`n` over 10", "chat", "rejected by smg", row_n_over_10_chat),
    ("`stop` over 4 strings", "both", "rejected by smg", row_stop_over_4),
    ("`prompt` as token ids", "completions", "rejected by smg", row_token_id_prompt),
    ("a value out of range (`max_tokens` over the limit, `top_k` < -1, ...)", "both", "rejected", row_out_of_range),
    ("lm-eval `local-completions`, generation tasks", "completions", "honoured", row_lm_eval_generate),
    ("lm-eval `local-completions`, loglikelihood tasks", "completions", "ignored by smg", row_lm_eval_loglikelihood),
    ("guidellm's OpenAI backend", "both", "honoured", row_guidellm),
]


@pytest.mark.parametrize("field, endpoints, status, check", ROWS, ids=[r[3].__name__.removeprefix("row_") for r in ROWS])
def test_field(fleet: Fleet, field: str, endpoints: str, status: str, check: Callable[[Fleet], None]) -> None:
    check(fleet)


def readme_rows() -> list[tuple[str, str, str]]:
    text = README.read_text()
    table = text[text.index("| OpenAI field | endpoints | through `graphserve gateway` |"):].split("\n\n")[0]
    return [tuple(cell.strip() for cell in line.strip("|").split(" | ")[:3]) for line in table.splitlines()[2:]]


def test_readme_table_is_this_table() -> None:
    assert readme_rows() == [(field, endpoints, status) for field, endpoints, status, _ in ROWS]
