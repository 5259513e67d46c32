"""Structured outputs on a real model forward: every completion under a JSON schema parses and
validates, a regex matches the whole output, a choice is one of the choices; every kind through
every door (the Python API's Constraint and vLLM's StructuredOutputsParams, graphserve.v1 and
vLLM's engine protocol); the constrained rows share steps with free ones without changing them;
invalid constraints are clear errors in the Python API and both gRPC protocols."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as v
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from service import StructuredOutputsParams
from service.llm import LLM, Constraint, SamplingParams
from service.proto import inference_pb2 as pb
from tests.support.server import generate, generate_samples

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "role": {"enum": ["reader", "writer", "owner"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "role"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= "SELECT " column " FROM " table\ncolumn ::= "id" | "name"\ntable ::= "users" | "orders"'
SQL = r"SELECT (id|name) FROM (users|orders)"
ID = r"[A-Z][a-z]{2,5}-[0-9]{3}"
CHOICES = ("positive", "negative", "neutral")


def follows(kind: str, text: str) -> bool:
    """Whether a completion follows its constraint (SCHEMA, ID, CHOICES, GRAMMAR, any object)."""
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        if kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        return isinstance(value, dict)
    pattern = {"regex": ID, "choice": "|".join(CHOICES), "grammar": SQL}[kind]
    return re.fullmatch(pattern, text) is not None


def close_bias(tokenizer) -> dict[int, float]:  # noqa: ANN001
    """Random weights nest objects without end; a small bias toward "}" lets them close."""
    return {tokenizer.encode("}", add_special_tokens=False)[0]: 1.0}


@pytest.fixture(scope="module")
def llm(model_cache_dir) -> Iterator[LLM]:  # noqa: ANN001
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=16, max_seq_len=512,
             device="cpu", dtype="float32") as llm:
        yield llm


def sampled(constraint: Constraint, count: int, **extra) -> list[SamplingParams]:  # noqa: ANN003
    extra = {"max_tokens": 300, **extra}
    return [SamplingParams(temperature=1.0, seed=i, constraint=constraint, **extra) for i in range(count)]


def test_every_json_schema_completion_parses_and_validates(llm: LLM) -> None:
    outs = llm.generate(["Describe a user as JSON"] * 8, sampled(Constraint("json_schema", json.dumps(SCHEMA)), 8))
    for [out] in (o.outputs for o in outs):
        assert out.finish_reason == "stop", out.text  # ended by the grammar, not by max_tokens
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    objects = [o.outputs[0] for o in llm.generate(["{"] * 8, sampled(Constraint("json_object"), 8, max_tokens=400,
                                                                      logit_bias=close_bias(llm.tokenizer)))]
    assert all(o.finish_reason == "stop" and isinstance(json.loads(o.text), dict) for o in objects)
    assert max(len(o.token_ids) for o in objects) > 3  # not only "{}"
    assert all(re.fullmatch(ID, o.outputs[0].text) for o in llm.generate(["id:"] * 6, sampled(Constraint("regex", ID), 6)))
    picked = {o.outputs[0].text for o in llm.generate(["sentiment:"] * 12, sampled(Constraint("choice", CHOICES), 12))}
    assert picked <= set(CHOICES) and len(picked) >= 2
    sql = llm.generate(["query:"] * 6, sampled(Constraint("grammar", GRAMMAR), 6))
    assert all(re.fullmatch(SQL, o.outputs[0].text) for o in sql)


def test_every_kind_through_vllms_structured_outputs_params(llm: LLM) -> None:
    """vLLM's spelling, SamplingParams(structured_outputs=StructuredOutputsParams(...)), each field,
    the schema as a dict and as text: the completions follow it and end by the grammar."""
    kinds = [("json_schema", StructuredOutputsParams(json=SCHEMA)),
             ("json_schema", StructuredOutputsParams(json=json.dumps(SCHEMA))),
             ("regex", StructuredOutputsParams(regex=ID)), ("choice", StructuredOutputsParams(choice=list(CHOICES))),
             ("grammar", StructuredOutputsParams(grammar=GRAMMAR)),
             ("json_object", StructuredOutputsParams(json_object=True))]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs=so,
                             logit_bias=close_bias(llm.tokenizer) if kind == "json_object" else ())
              for seed in range(3) for kind, so in kinds]
    outs = llm.generate(["{"] * len(params), params)
    for (kind, _), out in zip(kinds * 3, outs, strict=True):
        [c] = out.outputs
        assert c.finish_reason == "stop", (kind, c.text)
        assert follows(kind, c.text), (kind, c.text)


def test_constrained_rows_leave_the_free_rows_of_their_steps_unchanged(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Once upon a time", "The quick brown fox"], free)
    mixed = llm.generate(["Once upon a time", "json please", "The quick brown fox", "pick"],
                         [free, sampled(Constraint("json_schema", json.dumps(SCHEMA)), 1)[0], free,
                          SamplingParams(temperature=0.0, constraint=Constraint("choice", ("a", "b")))])
    mixed = [o.outputs[0] for o in mixed]
    assert [mixed[0].token_ids, mixed[2].token_ids] == [a.outputs[0].token_ids for a in alone]
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
    assert mixed[3].text in ("a", "b")


def test_constraints_combine_with_logprobs_penalties_and_seeds(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=300, logprobs=2, repetition_penalty=1.2,
                            constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    first, again = (o.outputs[0] for o in llm.generate(["a", "a"], [params, params]))
    assert first.token_ids == again.token_ids and len(first.logprobs) == len(first.token_ids)
    jsonschema.validate(json.loads(first.text), SCHEMA)


@pytest.mark.parametrize(("constraint", "needle"), [
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", '{"type": "frobnicate"}'), "json_schema"),
    (Constraint("regex", "(unclosed"), "regex"),
    (Constraint("grammar", "root ::= missing_rule"), "grammar"),
    (Constraint("choice", ()), "empty"),
])
def test_invalid_constraints_are_clear_errors(llm: LLM, constraint: Constraint, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        llm.generate(["hi"], SamplingParams(constraint=constraint))


def test_structured_outputs_over_both_grpc_protocols(server) -> None:  # noqa: ANN001
    stub = server.stub()
    sampling = pb.SamplingParams(temperature=1.0, seed=3, json_schema=json.dumps(SCHEMA))
    chunks, finished = generate_samples(stub, 3, text="user:", sampling=sampling,
                                        stopping=pb.StoppingCriteria(max_tokens=300))
    for i in range(3):
        assert finished[i].finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads("".join(c.text for c in chunks if c.index == i)), SCHEMA)
    chunks, _ = generate(stub, text="pick:", sampling=pb.SamplingParams(choice=pb.Choices(choices=["left", "right"])),
                         stopping=pb.StoppingCriteria(max_tokens=20))
    assert "".join(c.text for c in chunks) in ("left", "right")
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    answer = [r for r in engine.Generate(v.GenerateRequest(
        text="id:", sampling_params=v.SamplingParams(temperature=1.0, max_tokens=30, regex=r"[0-9]{4}")), timeout=60)]
    ids = list(answer[-1].complete.output_ids)
    assert re.fullmatch(r"[0-9]{4}", server.app.tokenizer.decode(ids)) and answer[-1].complete.finish_reason == "stop"
    for call in (lambda: list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex="(")))),
                 lambda: list(engine.Generate(v.GenerateRequest(text="x", sampling_params=v.SamplingParams(
                     json_schema="{bad"))))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "regex" in info.value.details() or "json_schema" in info.value.details()


def grpc_constraint(kind: str, message: type) -> dict:
    """The constraint fields of a sampling message (graphserve.v1's or vLLM's) for each kind."""
    choice = message.DESCRIPTOR.fields_by_name["choice"].message_type._concrete_class
    return {"json_schema": {"json_schema": json.dumps(SCHEMA)}, "json_object": {"json_object": True},
            "regex": {"regex": ID}, "grammar": {"grammar": GRAMMAR},
            "choice": {"choice": choice(choices=list(CHOICES))}}[kind]


@pytest.mark.parametrize("kind", ["json_schema", "json_object", "regex", "grammar", "choice"])
def test_every_kind_over_both_grpc_protocols(server, kind: str) -> None:  # noqa: ANN001
    """Each constraint field of graphserve.v1 and of vLLM's engine protocol: the streamed text follows
    it and the finish is a stop, on both protocols of one port."""
    bias = close_bias(server.app.tokenizer) if kind == "json_object" else {}
    sampling = pb.SamplingParams(temperature=1.0, seed=2, logit_bias=bias, **grpc_constraint(kind, pb.SamplingParams))
    chunks, finished = generate(server.stub(), text="{", sampling=sampling, stopping=pb.StoppingCriteria(max_tokens=400))
    text = "".join(c.text for c in chunks)
    assert finished.finish_reason == pb.FINISH_REASON_STOP and follows(kind, text), text
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    answer = list(engine.Generate(v.GenerateRequest(text="{", sampling_params=v.SamplingParams(
        temperature=1.0, seed=2, max_tokens=400, logit_bias=bias, **grpc_constraint(kind, v.SamplingParams))), timeout=60))
    complete = answer[-1].complete
    text = server.app.tokenizer.decode(list(complete.output_ids))
    assert complete.finish_reason == "stop" and follows(kind, text), text


def test_constrained_requests_give_the_same_tokens_with_and_without_overlapped_steps(llm: LLM, model_cache_dir) -> None:  # noqa: ANN001
    """With overlap the engine reads step t while step t + 1's forward pass runs, and fills t + 1's
    masks after that: the tokens must be those of stepping one at a time."""
    params = sampled(Constraint("json_schema", json.dumps(SCHEMA)), 6) + [SamplingParams(temperature=0.0, max_tokens=40,
                                                                                         ignore_eos=True)]
    prompts = ["Describe a user as JSON"] * 6 + ["free text"]
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=16, max_seq_len=512, device="cpu",
             dtype="float32", overlap_steps=False) as stepwise:
        want = [o.outputs[0].token_ids for o in stepwise.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
