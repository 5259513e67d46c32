"""The sampling fields on the GPU with CUDA graphs on: logprobs, prompt logprobs, penalties, bias,
min_tokens and structured outputs give what the eager run gives (float32), the sampler's CUDA path equals its CPU
path, and a step with constrained rows still replays its graph."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from service.engine.request import SamplingParams as EngineParams
from service.engine.sampler import SampleRow, SamplingBatch, TokenHistory, sample, unpack_logprobs
from service.engine.structured import GrammarCompiler, apply_bitmask
from service.llm import LLM, Constraint, SamplingParams
from service.model.loader import LoadedModel
from tests.gpu.test_overlap_gpu import loaded  # noqa: F401 - the tiny model on cuda, float32 (a fixture)
from tests.integration.test_structured_outputs import SCHEMA

pytestmark = pytest.mark.gpu
PROMPTS = ["Explain CUDA graphs", "The quick brown fox", "Once upon a time there was", "graphs replay kernels"]


@pytest.fixture(scope="module")
def llms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, LLM]]:
    cache = tmp_path_factory.mktemp("cache")
    common = dict(model="builtin:tiny", model_cache_dir=cache, device="cuda", dtype="float32", max_running_seqs=16,
                  max_seq_len=512)
    with LLM(cudagraph_mode="full_and_piecewise", **common) as graphed, LLM(cudagraph_mode="none", **common) as eager:
        yield graphed, eager


def replays(llm: LLM) -> int:
    return sum(b.since_start.replays for b in llm.graph_cache_state().buckets)


def test_logprobs_and_penalties_with_graphs_equal_eager(llms: tuple[LLM, LLM]) -> None:
    graphed, eager = llms
    eos = graphed.tokenizer.eos_token_id
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5, repetition_penalty=1.4,
                             presence_penalty=0.5, frequency_penalty=0.5),
              SamplingParams(temperature=0.9, seed=3, max_tokens=24, logprobs=1, min_p=0.05, logit_bias={7: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=6, logit_bias={eos: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    before = replays(graphed)
    got, want = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert replays(graphed) > before
    got, want = [o.outputs[0] for o in got], [o.outputs[0] for o in want]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert [lp.logprob for d in g.logprobs for lp in d.values()] == pytest.approx(
                [lp.logprob for d in w.logprobs for lp in d.values()], abs=1e-4)
            assert [list(d) for d in g.logprobs] == [list(d) for d in w.logprobs]
    assert len(got[2].token_ids) == 6 and got[2].finish_reason == "stop" and got[2].stop_reason is None  # EOS


def test_prompt_logprobs_with_graphs_equal_eager(llms: tuple[LLM, LLM]) -> None:
    graphed, eager = llms
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, graphed.vocab_size, (n,), generator=gen).tolist() for n in (300, 37, 2, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=5)
    graphed.generate(prompts, params)  # the prompt-sized pieces are captured lazily: the second run replays them
    before = replays(graphed)
    got, want = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert replays(graphed) > before
    for g, w, prompt in zip(got, want, prompts):
        assert len(g.prompt_logprobs) == len(prompt) and g.prompt_logprobs[0] is None
        assert [lp.logprob for d in g.prompt_logprobs[1:] for lp in d.values()] == pytest.approx(
            [lp.logprob for d in w.prompt_logprobs[1:] for lp in d.values()], abs=1e-4)
        assert [list(d) for d in g.prompt_logprobs[1:]] == [list(d) for d in w.prompt_logprobs[1:]]
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_structured_outputs_with_graphs_are_valid_and_replay(llms: tuple[LLM, LLM]) -> None:
    graphed, eager = llms
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300, constraint=constraint) for i in range(8)]
    before = replays(graphed)
    got = graphed.generate(["Describe a user as JSON"] * 8, params)
    assert replays(graphed) > before  # constrained steps replay their graphs
    for [out] in (o.outputs for o in got):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in eager.generate(["Describe a user as JSON"] * 8, params)]


def test_the_samplers_cuda_path_equals_its_cpu_path(llms: tuple[LLM, LLM]) -> None:
    graphed, _ = llms
    vocab = 2048
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen) * 4
    params = [EngineParams(temperature=0.0, repetition_penalty=1.5, logprobs=4),
              EngineParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((5, 9.0),)),
              EngineParams(temperature=0.8, seed=4, min_p=0.1, logprobs=0),
              EngineParams(temperature=0.0),
              EngineParams(temperature=1.0, seed=9, top_k=50, top_p=0.9, repetition_penalty=1.2),
              EngineParams(temperature=0.0, logit_bias=((11, 100.0),))]
    rows = [SampleRow(p, 3, r, (17,) if r == 3 else ()) for r, p in enumerate(params)]
    prompts = [[1, 2, 3], [5, 5], [8], [9, 10], [11, 12, 13], [4]]
    outs = []
    for device in ("cpu", "cuda"):
        history = TokenHistory(6, vocab, device)
        for r, prompt in enumerate(prompts):
            history.reset(r, r, prompt, [prompt[0], 20 + r])
        batch = SamplingBatch.build(rows, device)
        out = sample(logits.to(device), batch, history)
        outs.append((out.tokens.tolist(), unpack_logprobs(out.logprobs.tolist(), batch.logprobs[2]), history.counts.cpu()))
    (cpu_t, cpu_lp, cpu_h), (cuda_t, cuda_lp, cuda_h) = outs
    assert cpu_t == cuda_t and torch.equal(cpu_h, cuda_h)
    for a, b in zip(cpu_lp, cuda_lp):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and [t for t, _ in a.top] == [t for t, _ in b.top]
    # Grammar masks: applied on the GPU as on the CPU.
    compiler = GrammarCompiler(graphed.tokenizer, graphed.vocab_size, [graphed.tokenizer.eos_token_id])
    matcher = compiler.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    mask = torch.full((1, (graphed.vocab_size + 31) // 32), -1, dtype=torch.int32).pin_memory()
    matcher.fill_bitmask(mask, 0)
    row = torch.randn(1, graphed.vocab_size)
    on_gpu = row.cuda()
    apply_bitmask(row, mask)
    apply_bitmask(on_gpu, mask)
    torch.cuda.synchronize()
    assert torch.equal(row, on_gpu.cpu())


def test_the_sampling_kernels_equal_their_torch_paths_at_serving_size() -> None:
    from service.model.kernels import sampling as k

    device = torch.device("cuda")
    assert k._use_triton(device), "the Triton kernels should pass their self-check on this GPU"
    gen = torch.Generator(device=device).manual_seed(1)
    vocab, rows = 128256, torch.arange(0, 128, 2, device=device)
    logits = torch.randn(128, vocab, device=device, generator=gen) * 4
    mask = torch.randint(-2**31, 2**31 - 1, (64, (vocab + 31) // 32), device=device, dtype=torch.int32, generator=gen)
    want, got = logits.clone(), logits.clone()
    k.apply_bitmask_torch(want, rows, mask)
    k.apply_bitmask(got, rows, mask)
    assert torch.equal(want, got)
    counts = torch.randint(0, 4, (257, vocab), device=device, dtype=torch.int32, generator=gen)
    in_prompt = torch.rand(257, vocab, device=device, generator=gen) < 0.01
    args = (rows, torch.randperm(257, device=device)[:64], counts, in_prompt, torch.rand(64, device=device) * 2 - 1,
            torch.rand(64, device=device), torch.rand(64, device=device) + 0.5)
    want, got = logits.clone(), logits.clone()
    k.apply_penalties_torch(want, *args)
    k.apply_penalties(got, *args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_the_runner_checks_the_sampling_kernels_before_serving(loaded: LoadedModel) -> None:  # noqa: F811
    """The kernels' self-check and their compile at the model's vocabulary run in the runner's warm-up:
    at the first request with a grammar, on the engine thread, they stalled every stream 1.1-1.2 s."""
    from cache_manager import CudaGraphMode, GraphCacheConfig
    from service.engine.runner import ModelRunner
    from service.model.kernels import sampling as k

    k._triton_checked.cache_clear()
    ModelRunner(loaded, 2, 64, GraphCacheConfig(mode=CudaGraphMode.NONE, capture_sizes=None, max_batch=2)).warmup()
    assert k._triton_checked.cache_info().currsize == 1
    checks = k._triton_checked.cache_info().misses
    # the serving path's logits live on "cuda:0" where the runner may name "cuda": no second check there
    logits = torch.zeros(3, loaded.spec.vocab_size, device=torch.device("cuda", torch.cuda.current_device()))
    k.apply_bitmask(logits, torch.tensor([0], device=logits.device),
                    torch.full((1, (logits.shape[1] + 31) // 32), -1, dtype=torch.int32, device=logits.device))
    assert k._triton_checked.cache_info().misses == checks
