"""The in-process Python API (`from service import LLM, SamplingParams`) on the built-in model (CPU).

It runs the server's engine, so for the same prompts and parameters it must produce what a real
gRPC server produces.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Iterator

import pytest

from service import LLM, SamplingParams
from service.chat import ChatError
from service.config import ConfigError, load_config
from service.model.spec import ModelLoadError
from service.proto import inference_pb2
from tests.support.server import ServerThread, generate, greedy

PROMPTS = ["Explain CUDA graphs", "The quick brown fox", "Once upon a time", "graphs replay kernels"]
CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a graph?"}]


@pytest.fixture(scope="module")
def llm(model_cache_dir) -> Iterator[LLM]:  # noqa: ANN001
    """The same model, device and limits as the session's gRPC server (tests/conftest.py)."""
    extra = load_config(shlex.split(os.environ.get("GRAPHSERVE_TEST_ARGS", "")), {})  # as ServerThread adds them
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=16, max_seq_len=512,
             default_max_tokens=32, device=extra.device, dtype=extra.dtype) as llm:
        yield llm


def chat_request(messages: list[dict[str, str]]) -> inference_pb2.ChatMessages:
    return inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in messages])


def test_generate_greedy_equals_grpc_generate(llm: LLM, server: ServerThread) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    stub = server.stub()
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, out in zip(PROMPTS, outputs):
        chunks, finished = generate(stub, **greedy(prompt, 16))
        assert out.finished and out.request_id
        assert len(out.prompt_token_ids) == finished.usage.prompt_tokens
        [out] = out.outputs
        assert out.token_ids == [t for c in chunks for t in c.token_ids]
        assert out.text == "".join(c.text for c in chunks)
        assert out.finish_reason == "length" and out.stop_reason is None and len(out.token_ids) == 16
        assert out.timings.total_seconds >= out.timings.time_to_first_token_seconds > 0


def test_chat_over_grpc_equals_llm_chat(llm: LLM, server: ServerThread) -> None:
    out = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.prompt.startswith("<|begin_of_text|><|system|>\nAnswer briefly.") and out.prompt.endswith("<|assistant|>\n")
    chunks, finished = generate(server.stub(), messages=chat_request(CONVERSATION),
                                sampling=inference_pb2.SamplingParams(temperature=0.0),
                                stopping=inference_pb2.StoppingCriteria(max_tokens=12, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == out.outputs[0].token_ids
    assert finished.usage.prompt_tokens == len(out.prompt_token_ids)


def test_sampling_with_a_seed_reproduces_whatever_shares_the_batch(llm: LLM, server: ServerThread) -> None:
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Explain CUDA graphs", seeded)[0].outputs[0]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = llm.generate(PROMPTS, [seeded, others, others, others])[0].outputs[0]
    assert batched.token_ids == alone.token_ids and alone.seed == 7
    other_seed = llm.generate("Explain CUDA graphs", SamplingParams(temperature=0.8, top_p=0.95, seed=8, max_tokens=20,
                                                                     ignore_eos=True))[0].outputs[0]
    assert other_seed.token_ids != alone.token_ids
    chunks, _ = generate(server.stub(), text="Explain CUDA graphs",
                         sampling=inference_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=7),
                         stopping=inference_pb2.StoppingCriteria(max_tokens=20, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == alone.token_ids


def test_token_id_prompts_and_one_sampling_params_per_prompt(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The quick brown fox")
    outputs = llm.generate([ids, "Once upon a time"], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                                      SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    assert outputs[0].prompt is None and outputs[0].prompt_token_ids == ids
    by_text = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert by_text.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert llm.generate([]) == []


def test_stop_string_ends_the_text_before_it(llm: LLM) -> None:
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop = full.text[5:8]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop=stop))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]


def test_n_samples_are_the_generations_with_seeds_seed_plus_i(llm: LLM) -> None:
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True, n=3)
    outputs = llm.generate(["Once upon a time", "The quick brown fox"], params)
    assert len(outputs) == 2  # one output per prompt, its samples in outputs
    for prompt, out in zip(["Once upon a time", "The quick brown fox"], outputs):
        assert [c.index for c in out.outputs] == [0, 1, 2] and [c.seed for c in out.outputs] == [11, 12, 13]
        for c in out.outputs:
            [alone] = llm.generate(prompt, dataclasses.replace(params, seed=c.seed, n=1))[0].outputs
            assert (c.token_ids, c.text, c.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate("Once upon a time", params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outputs[0].outputs]


def test_greedy_samples_are_identical_and_each_has_its_own_logprobs(llm: LLM) -> None:
    [greedy_out] = llm.generate("graphs replay kernels", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                         n=2))
    first, second = greedy_out.outputs
    assert first.token_ids == second.token_ids and first.text == second.text and len(first.token_ids) == 4
    [out] = llm.generate("graphs replay kernels", SamplingParams(temperature=1.0, seed=21, max_tokens=4,
                                                                 ignore_eos=True, logprobs=2, n=2))
    for c in out.outputs:
        [alone] = llm.generate("graphs replay kernels", SamplingParams(temperature=1.0, seed=c.seed, max_tokens=4,
                                                                       ignore_eos=True, logprobs=2))[0].outputs
        assert c.token_ids == alone.token_ids  # logprobs to float32 rounding: the batch of two rows sums otherwise
        assert [lp.logprob for d in c.logprobs for lp in d.values()] == pytest.approx(
            [lp.logprob for d in alone.logprobs for lp in d.values()], abs=1e-4)
        assert [list(d) for d in c.logprobs] == [list(d) for d in alone.logprobs]
        assert len(c.logprobs) == 4 and all(len(d) in (2, 3) for d in c.logprobs)
    assert out.outputs[0].logprobs != out.outputs[1].logprobs


@pytest.mark.parametrize(("n", "shown"), [(17, "17"), (0, "0"), ("2", "'2'"), (2.0, "2.0"), (True, "True")])
def test_n_outside_one_to_sixteen_is_refused(llm: LLM, n: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.n must be (an int )?in \[1, 16\], got {re.escape(shown)}$"):
        SamplingParams(n=n)


def test_many_prompts_show_a_progress_bar(llm: LLM, capsys) -> None:
    outputs = llm.generate(["a b c"] * 10, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(outputs) == 10 and len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert "Generating" in capsys.readouterr().err
    llm.generate(["a b c"] * 10, SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Generating" not in capsys.readouterr().err


def test_chat_takes_a_list_of_conversations(llm: LLM) -> None:
    second = [{"role": "user", "content": "And a kernel?"}]
    both = llm.chat([CONVERSATION, second], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in both] == [
        llm.chat(c, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
        for c in (CONVERSATION, second)]
    with pytest.raises(ChatError, match=r"messages\[0\].role is 'robot'"):
        llm.chat([{"role": "robot", "content": "beep"}])


def test_bad_prompts_and_params_are_clear_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"the context of 512 tokens \(max_seq_len\): ask for at most"):
        llm.generate("hello", SamplingParams(max_tokens=600))
    with pytest.raises(ValueError, match=r"token id 5000 is outside the vocabulary \[0, 768\)"):
        llm.generate([[1, 5000]])
    # Next to a prompt with samples: refused before any sample is submitted.
    with pytest.raises(ValueError, match=r"prompt 1: token id 5000 is outside the vocabulary"):
        llm.generate([[1, 2], [1, 5000]], SamplingParams(max_tokens=2, n=4))
    assert llm._engine.num_running == llm._engine.num_waiting == 0
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="SamplingParams.temperature must be a finite number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="SamplingParams.top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="SamplingParams.ignore_eos must be True or False, got 'no'"):
        SamplingParams(ignore_eos="no")


def test_bytes_are_not_taken_for_token_ids(llm: LLM) -> None:
    # bytes are a sequence of ints: b"hello" would otherwise be the token ids [104, 101, 108, 108, 111].
    for prompts, name in ((b"hello", "prompts is bytes"), ([b"hello"], "prompt 0 is bytes"),
                          (["ok", bytearray(b"hi")], "prompt 1 is bytearray")):
        with pytest.raises(TypeError, match=rf"{name}: give text \(decode it first"):
            llm.generate(prompts, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, a {'prompt_token_ids': ids} dict or a list of "
                                        "those, not int"):
        llm.generate(5)


def test_graph_cache_state_is_the_admin_view(llm: LLM) -> None:
    state = llm.graph_cache_state()
    assert state.mode == "none"  # CPU: eager, as the server
    assert state.max_batch == 16 and list(state.capture_sizes) == [1, 2, 4, 8, 16]
    assert [b.size for b in state.buckets] == [1, 2, 4, 8, 16]


def test_the_seeds_snippets_run_as_written(model_cache_dir, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(model_cache_dir.parent))  # where builtin models are generated
    model = "builtin:tiny"
    # The seed's first line asks for 4 ranks: the tiny model's 2 KV heads do not split 4 ways, which is
    # said before any rank starts.
    with pytest.raises(ModelLoadError, match="num_key_value_heads 2 does not divide by tensor_parallel_size 4"):
        LLM(model=model, tensor_parallel_size=4, cudagraph_mode="FULL", cudagraph_capture_sizes=[64, 128, 256])
    llm = LLM(model=model, tensor_parallel_size=1, cudagraph_mode="FULL", cudagraph_capture_sizes=[64, 128, 256])
    sampling_params = SamplingParams(temperature=0.8, max_tokens=50)
    output = llm.generate("Explain CUDA graphs", sampling_params)
    assert len(output) == 1 and output[0].prompt == "Explain CUDA graphs"
    assert output[0].outputs[0].finish_reason in ("length", "stop") and 1 <= len(output[0].outputs[0].token_ids) <= 50
    assert list(llm.graph_cache_state().capture_sizes) == [64, 128, 256]
    llm.close()
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate("Explain CUDA graphs", sampling_params)
    llm.close()  # idempotent
    # The seed's LoRA line names a directory that does not exist here: said before anything loads.
    with pytest.raises(ConfigError, match="lora_weights: 'my/lora' is not a directory; give PEFT adapter directories"):
        LLM(model=model, lora_weights="my/lora", cudagraph_mode="FULL_AND_PIECEWISE")


def test_lora_adapter_names_must_be_loaded(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"lora adapter 'my/lora' is not loaded; loaded: none \(lora_weights\)"):
        llm.generate("Summarise the following text", SamplingParams(max_tokens=20), lora_adapter_names=["my/lora"])


def test_lora_weights_match_peft(model_cache_dir, tmp_path) -> None:  # noqa: ANN001
    from service.model import ensure_builtin
    from tests.support.lora import make_adapter, peft_greedy

    model_dir = ensure_builtin("tiny", model_cache_dir)
    first = make_adapter(model_dir, tmp_path / "first", seed=11)
    second = make_adapter(model_dir, tmp_path / "second", seed=12, r=4, targets=["o_proj", "down_proj"])
    prompts = [[766, 5, 6, 7], [766, 9, 10], [766, 40, 41, 42, 43]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=128,
             lora_weights=[str(first), f"short={second}"]) as llm:
        assert llm.adapters == tuple(sorted([str(first), "short"]))
        outs = llm.generate(prompts, params, lora_adapter_names=[str(first), "", "short"])
        with pytest.raises(ValueError, match="2 lora_adapter_names for 3 prompts"):
            llm.generate(prompts, params, lora_adapter_names=["short", ""])
    for prompt, adapter, out in zip(prompts, [first, None, second], outs):
        assert out.outputs[0].token_ids == peft_greedy(model_dir, adapter, prompt, 8)


def test_keywords_are_checked_before_loading() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'max_num_seq'; valid keywords: model, "
                                        r"tensor_parallel_size, .*max_running_seqs"):
        LLM(model="builtin:tiny", max_num_seq=8)
    with pytest.raises(ConfigError, match=r"cudagraph_mode must be one of none, full, piecewise, full_and_piecewise "
                                          r"\(any case\), not 'sometimes'"):
        LLM(model="builtin:tiny", cudagraph_mode="Sometimes")
    with pytest.raises(ConfigError, match=r"cudagraph_capture_sizes: capture size 4096 is outside \[1, 2048\]"):
        LLM(model="builtin:tiny", max_running_seqs=32, cudagraph_capture_sizes=[8, 4096])
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(model="builtin:tiny", tensor_parallel_size=0)


@pytest.mark.parametrize(("keyword", "value", "message"), [
    ("overlap_steps", "no", "overlap_steps must be True or False, got 'no' (str)"),
    ("warm_start", 0, "warm_start must be True or False, got 0 (int)"),
    ("batch_invariant", None, "batch_invariant must be True or False, got None (NoneType)"),
    ("max_running_seqs", "8", "max_running_seqs must be an int or None, got '8' (str)"),
    ("max_seq_len", 512.0, "max_seq_len must be an int, got 512.0 (float)"),
    ("tensor_parallel_size", True, "tensor_parallel_size must be an int, got True (bool)"),
    ("seed", "7", "seed must be an int or None, got '7' (str)"),
    ("cudagraph_capture_sizes", "8,16", "cudagraph_capture_sizes must be None or a list of ints, got '8,16' (str)"),
    ("cudagraph_capture_sizes", [8, "16"], "cudagraph_capture_sizes must be None or a list of ints"),
    ("graph_memory_budget", True, "graph_memory_budget must be None, bytes"),
    ("device", None, "device must be a string, got None"),
])
def test_keywords_of_the_wrong_type_are_type_errors(keyword: str, value: object, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        LLM(model="builtin:tiny", **{keyword: value})
