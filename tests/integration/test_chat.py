"""Chat over gRPC: GenerateRequest.messages rendered with the model's chat template."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import structlog

from service import cli
from service.model.builtin import ensure_builtin
from service.model.loader import read_tokenizer
from service.proto import inference_pb2 as pb
from tests.support.server import generate, greedy, running_server

CONVERSATION = [("system", "Answer briefly."), ("user", "What is a graph?")]


def chat(turns: list[tuple[str, str]]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


def greedy_chat(turns: list[tuple[str, str]], max_tokens: int) -> dict:
    return dict(messages=chat(turns), sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))


def test_chat_equals_the_template_rendered_prompt_as_token_ids(server, model_cache_dir) -> None:
    tok = read_tokenizer(ensure_builtin("tiny", model_cache_dir))
    ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in CONVERSATION], tokenize=True,
                                  add_generation_prompt=True, return_dict=False)
    stub = server.stub()
    chunks, finished = generate(stub, **greedy_chat(CONVERSATION, 10))
    by_ids, _ = generate(stub, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
                         stopping=pb.StoppingCriteria(max_tokens=10, ignore_eos=True))
    assert finished.usage.prompt_tokens == len(ids)
    assert [t for c in chunks for t in c.token_ids] == [t for c in by_ids for t in c.token_ids]


BAD_CHATS = {
    "no messages": (pb.ChatMessages(), "prompt.messages is empty"),
    "unknown role": (chat([("user", "hi"), ("robot", "beep")]), "messages[1].role is 'robot'; use one of system"),
    "empty role": (chat([("", "hi")]), "messages[0].role is ''"),
    "empty content": (chat([("system", "Be brief."), ("user", "")]), "messages[1].content is empty"),
    "over the prompt limit": (chat([("user", "x" * ((1 << 20) + 1))]), "over the limit of 1048576 bytes"),
}


@pytest.mark.parametrize("name", list(BAD_CHATS))
def test_bad_chat_input_is_invalid_argument(server, name: str) -> None:
    messages, needle = BAD_CHATS[name]
    stub = server.stub()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(messages=messages), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    _, finished = generate(stub, **greedy("still serving", 2))
    assert finished.usage.completion_tokens == 2


def test_a_model_without_chat_template_says_so(model_cache_dir, tmp_path) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(ensure_builtin("tiny", model_cache_dir), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(["--model", str(model), "--max-running-seqs", "2", "--max-seq-len", "128"]) as srv:
        stub = srv.stub()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(messages=chat(CONVERSATION)), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "has no chat template" in info.value.details() and "send the prompt as text" in info.value.details()
        _, finished = generate(stub, **greedy("text still works", 2))
        assert finished.usage.completion_tokens == 2


def test_graphserve_generate_chat_prints_the_answer(server, capsys) -> None:
    chunks, _ = generate(server.stub(), messages=chat(CONVERSATION), sampling=pb.SamplingParams(temperature=0.0),
                         stopping=pb.StoppingCriteria(max_tokens=6))
    capsys.readouterr()
    with structlog.testing.capture_logs():  # the server's logs (same process) stay out of the client's stdout
        code = cli.main(["generate", "--target", server.address, "--system", "Answer briefly.", "--chat",
                         "What is a graph?", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == "".join(c.text for c in chunks)
    assert "prompt + " in err
