"""Code written for vLLM's offline API runs on graphserve's Python API with only the import changed:
the outputs, SamplingParams and LLM keywords as vLLM's, on the built-in model."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Iterator

import huggingface_hub.constants
import pytest

from service import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams, StructuredOutputsParams
from service.config import ConfigError, load_config
from service.llm_config import config_of
from service.model import ModelLoadError, ensure_builtin

# vLLM's quick start (docs.vllm.ai, "Offline batched inference"), the import line changed; the model
# is graphserve's built-in one (a local Hugging Face directory works the same way).
QUICKSTART = '''
from service import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="builtin:tiny")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


@pytest.fixture(scope="module")
def llm(model_cache_dir) -> Iterator[LLM]:  # noqa: ANN001
    """vLLM's keywords where graphserve's would do."""
    extra = load_config(shlex.split(os.environ.get("GRAPHSERVE_TEST_ARGS", "")), {})
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_num_seqs=8, max_model_len=256,
             enforce_eager=True, tokenizer="builtin:tiny", device=extra.device, dtype=extra.dtype) as llm:
        yield llm


def complete(llm: LLM, prompt: object, **params: object) -> CompletionOutput:
    [out] = llm.generate(prompt, SamplingParams(**params))
    [completion] = out.outputs
    return completion


def test_vllm_quickstart_runs_with_only_the_import_changed(model_cache_dir, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("XDG_CACHE_HOME", str(model_cache_dir.parent))  # where the built-in model is generated
    namespace: dict[str, object] = {}
    exec(compile(QUICKSTART, "vllm_quickstart.py", "exec"), namespace)  # noqa: S102
    namespace["llm"].close()
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"Prompt: '(.*)', Generated text: ", line)[1] for line in lines] == namespace["prompts"]
    outputs = namespace["outputs"]
    assert all(isinstance(o, RequestOutput) and o.finished and len(o.outputs) == 1 for o in outputs)
    assert len({o.request_id for o in outputs}) == 4
    for output, line in zip(outputs, lines):
        [completion] = output.outputs
        assert line.endswith(f"Generated text: {completion.text!r}") and completion.text
        assert completion.finish_reason in ("stop", "length") and completion.token_ids
        assert completion.cumulative_logprob is None and completion.logprobs is None  # not asked for


def test_a_hub_model_id_in_the_local_hugging_face_cache_loads_as_vllm_users_name_it(
        llm: LLM, model_cache_dir, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    # The Hub library's cache layout: models--org--name/refs/main names the snapshot of revision main.
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(ensure_builtin("tiny", model_cache_dir), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    with LLM(model="acme/tiny-chat", max_num_seqs=2, max_model_len=256, device=llm.config.device,
             dtype=llm.config.dtype) as hub_llm:
        assert complete(hub_llm, "Hello", **greedy).token_ids == complete(llm, "Hello", **greedy).token_ids
    with pytest.raises(ModelLoadError, match=r"acme/other: .* nor a model id in the local Hugging Face cache"):
        LLM(model="acme/other")


def test_the_llm_takes_vllms_keywords(llm: LLM) -> None:
    c = llm.config
    assert (c.max_running_seqs, c.max_seq_len, c.cudagraph_mode) == (8, 256, "none")
    assert llm.graph_cache_state().mode == "none"
    assert config_of("builtin:tiny", {"kv_cache_memory_bytes": 1 << 20}).kv_cache_memory == "1048576B"
    assert config_of("builtin:tiny", {"enforce_eager": False}).cudagraph_mode == config_of("builtin:tiny", {}).cudagraph_mode
    assert config_of("builtin:tiny", {"gpu_memory_utilization": None, "trust_remote_code": False}) == config_of(
        "builtin:tiny", {})
    with pytest.raises(ConfigError, match="max_model_len"):  # the server's check, naming vLLM's keyword
        config_of("builtin:tiny", {"max_model_len": 0})


@pytest.mark.parametrize(("keywords", "message"), [
    ({"gpu_memory_utilization": 0.9}, "'gpu_memory_utilization' (vLLM's) has no equal in graphserve: graphserve sizes "
                                      "the KV cache alone"),
    ({"trust_remote_code": True}, "'trust_remote_code' (vLLM's) has no equal in graphserve: graphserve runs its own "
                                  "model code"),
    ({"tokenizer": "/models/other"}, "'tokenizer' is '/models/other': graphserve uses the model's own tokenizer"),
    ({"max_model_len": 256, "max_seq_len": 256}, "max_model_len and max_seq_len set the same thing"),
    ({"kv_cache_memory_bytes": 1 << 20, "kv_cache_memory": "1MiB"}, "kv_cache_memory_bytes and kv_cache_memory set"),
    ({"swap_space": 4}, "unexpected keyword argument(s) 'swap_space'"),
])
def test_vllm_keywords_without_an_equal_are_refused_by_name(keywords: dict, message: str) -> None:
    with pytest.raises(TypeError, match=re.escape(message)):
        config_of("builtin:tiny", keywords)


def test_length_and_stop_finish_reasons_and_stop_reason(llm: LLM) -> None:
    prompt = "Once upon a time"
    full = complete(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True)
    assert (full.finish_reason, full.stop_reason, len(full.token_ids)) == ("length", None, 16)
    assert full.finished()
    # A stop string: finish "stop", stop_reason the string, the text before it (or through it).
    stop = full.text[4:7]
    by_string = complete(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    assert by_string.text == full.text[:full.text.index(stop)]
    kept = complete(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[:full.text.index(stop)] + stop and kept.token_ids == by_string.token_ids
    # A stop token id: stop_reason the id.
    at = next(i for i, t in enumerate(full.token_ids) if i >= 2 and t not in full.token_ids[:i])
    by_id = complete(llm, prompt, temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[full.token_ids[at]])
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", full.token_ids[at])
    assert by_id.token_ids == full.token_ids[:at]  # graphserve leaves the stop token out (vLLM keeps it)
    # The end-of-sequence token: "stop" as in vLLM, with stop_reason None.
    eos = llm.get_tokenizer().eos_token_id
    by_eos = complete(llm, prompt, temperature=0, max_tokens=16, min_tokens=2, logit_bias={eos: 100.0})
    assert (by_eos.finish_reason, by_eos.stop_reason, len(by_eos.token_ids)) == ("stop", None, 2)


def test_logprobs_are_vllms_dicts_and_cumulative_logprob_their_sum(llm: LLM) -> None:
    out = complete(llm, "The quick brown fox", temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=3)
    tokenizer = llm.get_tokenizer()
    assert len(out.logprobs) == len(out.token_ids) == 8
    for token, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == token  # the sampled token first, then the top 3
        assert all(isinstance(lp, Logprob) and lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
        chosen = entry[token]  # its rank in the whole vocabulary: one more than the tokens more likely
        assert len(entry) == (3 if chosen.rank <= 3 else 4)
        assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for lp in top) or (
            chosen.rank > 3 and chosen.logprob <= top[-1].logprob)
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))
    assert out.cumulative_logprob < 0
    greedy = complete(llm, "The quick brown fox", temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    assert [list(d) for d in greedy.logprobs] == [[t] for t in greedy.token_ids]
    assert all(d[t].rank == 1 for t, d in zip(greedy.token_ids, greedy.logprobs))


def test_token_id_prompts_and_get_tokenizer(llm: LLM) -> None:
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text, by_ids, by_dict = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, ids], params)
    assert by_text.prompt == text and by_text.prompt_token_ids == ids
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids == by_dict.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert llm.get_tokenizer().decode(by_ids.outputs[0].token_ids) == by_ids.outputs[0].text
    [alone] = llm.generate({"prompt_token_ids": ids}, params)
    assert alone.outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt 0: 'multi_modal_data' not supported \(graphserve serves text-only"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {}}])
    with pytest.raises(ValueError, match="prompt 1: give one of 'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate([text, {"prompt": text, "prompt_token_ids": ids}])
    with pytest.raises(ValueError, match="prompt 0: 'prompt' takes text and 'prompt_token_ids' a list of token ids, not str"):
        llm.generate({"prompt_token_ids": text})


def test_vllm_sampling_fields_graphserve_honours(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("one two three four five six")
    [out] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3))
    assert out.prompt_token_ids == ids[-3:]
    silent = complete(llm, ids, temperature=0, max_tokens=4, ignore_eos=True, detokenize=False, logprobs=1)
    assert silent.text == "" and len(silent.token_ids) == 4
    assert all(lp.decoded_token is None for d in silent.logprobs for lp in d.values())
    picked = complete(llm, "sentiment:", temperature=0, max_tokens=8, skip_special_tokens=True,
                      spaces_between_special_tokens=False,
                      structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
    assert picked.text in ("positive", "negative") and picked.finish_reason == "stop"
    as_json = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert (as_json.constraint.kind, as_json.constraint.value) == ("json_schema", '{"type": "object"}')


@pytest.mark.parametrize(("fields", "needle"), [
    (dict(skip_special_tokens=False), "SamplingParams.skip_special_tokens=False is not supported by graphserve"),
    (dict(bad_words=["bad"]), "SamplingParams.bad_words=['bad'] is not supported by graphserve"),
    (dict(allowed_token_ids=[1, 2]), "SamplingParams.allowed_token_ids=[1, 2] is not supported"),
    (dict(logits_processors=[print]), "SamplingParams.logits_processors="),
    (dict(extra_args={"k": 1}), "SamplingParams.extra_args={'k': 1} is not supported"),
    (dict(flat_logprobs=True), "SamplingParams.flat_logprobs=True is not supported"),
    (dict(truncate_prompt_tokens=0), "SamplingParams.truncate_prompt_tokens must be None, an int >= 1 or -1"),
    (dict(stop=["x"], detokenize=False), "SamplingParams.stop needs detokenize=True"),
    (dict(structured_outputs=StructuredOutputsParams(regex="a", choice=["b"])),
     "SamplingParams.structured_outputs needs exactly one of json, regex, choice, grammar, json_object=True; got regex, choice"),
])
def test_vllm_sampling_fields_graphserve_cannot_honour_name_the_field(fields: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams(**fields)
