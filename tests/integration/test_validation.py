"""Every bad input gets INVALID_ARGUMENT naming the field, and the server keeps serving."""

from __future__ import annotations

import math

import grpc
import pytest

from service.proto import inference_pb2 as pb
from tests.support.server import generate, greedy

S, T = pb.SamplingParams, pb.StoppingCriteria

BAD_REQUESTS = {
    "no prompt": (dict(), "prompt"),
    "empty text": (dict(text=""), "prompt.text"),
    "empty token ids": (dict(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
    "token id past vocab": (dict(token_ids=pb.TokenIds(ids=[1, 10**9])), "outside the vocabulary"),
    "max_tokens zero": (dict(text="hi", stopping=T(max_tokens=0)), "max_tokens"),
    "prompt plus max_tokens over context": (dict(text="hi", stopping=T(max_tokens=4000)), "max_tokens"),
    "negative temperature": (dict(text="hi", sampling=S(temperature=-1)), "temperature"),
    "nan temperature": (dict(text="hi", sampling=S(temperature=math.nan)), "temperature"),
    "infinite temperature": (dict(text="hi", sampling=S(temperature=math.inf)), "temperature"),
    "top_p zero": (dict(text="hi", sampling=S(top_p=0.0)), "top_p"),
    "top_p above one": (dict(text="hi", sampling=S(top_p=1.5)), "top_p"),
    "stop id past vocab": (dict(text="hi", stopping=T(stop_token_ids=[10**6])), "stop_token_ids"),
    "too many stop strings": (dict(text="hi", stopping=T(stop=["x"] * 100)), "stopping.stop"),
    "too long stop string": (dict(text="hi", stopping=T(stop=["x" * 5000])), "stopping.stop"),
    "empty stop string": (dict(text="hi", stopping=T(stop=[""])), "stopping.stop"),
    "stream_interval zero": (dict(text="hi", stream_interval=0), "stream_interval"),
    "prompt over the context": (dict(token_ids=pb.TokenIds(ids=[1] * 600)), "--max-seq-len"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_serving_continues(server, name: str) -> None:
    fields, needle = BAD_REQUESTS[name]
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    _, finished = generate(stub, **greedy("still serving", 3))
    assert finished.usage.completion_tokens == 3


@pytest.mark.parametrize("temperature", [1e-45, 1e-6])
def test_a_temperature_below_the_epsilon_is_greedy(server, temperature: float) -> None:
    # 1e-45 used to scale the logits to +-inf: the stream repeated the first token with a positive logit.
    stub, prompt = server.stub(), "The capital of France"
    expected = [t for c in generate(stub, **greedy(prompt, 12))[0] for t in c.token_ids]
    chunks, _ = generate(stub, text=prompt, sampling=S(temperature=temperature, seed=3),
                         stopping=T(max_tokens=12, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == expected
