"""lm-eval and guidellm, the real tools (`make eval-tools` puts them in .venv-eval), against one replica
of the built-in model behind the real smg, as `graphserve gateway` runs it. lm-eval's answers must be
the ones graphserve gives the openai client for the same prompts; guidellm's benchmark must complete
every request with the output length it asked for."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as v

from tests.integration.test_gateway import MODEL, client, engine_stub, replicas_behind_smg
from tests.support.gateway import Gateway, find_smg

pytestmark = pytest.mark.skipif(find_smg() is None, reason="smg is not installed (the dev extra has it)")

EVAL_BIN = Path(__file__).resolve().parents[2] / ".venv-eval" / "bin"
QUESTIONS = [
    {"question": "What is two plus two?", "answer": "4"},
    {"question": "What colour is the sky?", "answer": "blue"},
    {"question": "Name a prime number.", "answer": "7"},
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "How many legs has a spider?", "answer": "8"},
]
MAX_GEN_TOKS = 16
OUTPUT_TOKENS = 8  # guidellm's synthetic requests ask for this many
TASK = """\
task: graphserve_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA_FILE
test_split: test
output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: MAX_GEN_TOKS
metric_list:
  - metric: exact_match
"""


@dataclass
class Fleet:
    gateway: Gateway
    oa: openai.OpenAI
    tokenizer_dir: str  # the replica's model directory: the gateway serves no tokenizer over HTTP

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


@pytest.fixture(scope="module")
def fleet(model_cache_dir, tmp_path_factory) -> Iterator[Fleet]:  # noqa: ANN001
    with replicas_behind_smg(1, model_cache_dir, tmp_path_factory.mktemp("eval"), "eval") as ([replica], gateway):
        tokenizer_dir = engine_stub(replica).GetModelInfo(v.GetModelInfoRequest(), timeout=5).tokenizer_path
        yield Fleet(gateway, client(gateway), tokenizer_dir)


def eval_tool(name: str) -> str:
    """.venv-eval's `name`, or a skip where it is not built (a failure under CI, which builds it)."""
    path = EVAL_BIN / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: .ci/run builds it with `make eval-tools`")
        pytest.skip(f"{name} is not installed (make eval-tools builds .venv-eval)")
    return str(path)


# Module-scoped and named before `fleet` in the tests' arguments: a missing tool skips before replicas start.
@pytest.fixture(scope="module")
def lm_eval() -> str:
    return eval_tool("lm_eval")


@pytest.fixture(scope="module")
def guidellm() -> str:
    return eval_tool("guidellm")


def run_tool(argv: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    """The tool offline, with its Hugging Face caches in tmp_path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}: {done.stderr[-4000:]}"
    return done


def only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


def test_lm_eval_generation_task_gets_graphserve_greedy_answers(lm_eval: str, fleet: Fleet, tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "graphserve_qa.yaml").write_text(TASK.replace("DATA_FILE", str(data)).replace("MAX_GEN_TOKS", str(MAX_GEN_TOKS)))
    model_args = (f"base_url={fleet.gateway.base_url}/completions,model={MODEL},tokenizer_backend=None,"
                  "tokenized_requests=False,num_concurrent=2,max_retries=1")
    run_tool([lm_eval, "--model", "local-completions", "--model_args", model_args, "--include_path", str(tasks),
              "--tasks", "graphserve_qa", "--limit", str(len(QUESTIONS)), "--output_path", str(tmp_path / "out"),
              "--log_samples"], tmp_path, timeout=120)

    results = json.loads(only(sorted((tmp_path / "out").rglob("results_*.json"))).read_text())
    scores = results["results"]["graphserve_qa"]
    assert "exact_match,none" in scores and scores["sample_len"] == len(QUESTIONS), scores
    samples = [json.loads(line) for line in only(sorted((tmp_path / "out").rglob("samples_graphserve_qa_*.jsonl")))
               .read_text().splitlines()]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        assert prompt == f"Q: {sample['doc']['question']}\nA:"
        ours = fleet.oa.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_GEN_TOKS, temperature=0,
                                           stop=["\n"]).choices[0].text
        assert sample["resps"][0][0] == ours, (prompt, sample["resps"], ours)


def test_guidellm_benchmark_completes_every_request(guidellm: str, fleet: Fleet, tmp_path: Path) -> None:
    report = tmp_path / "benchmarks.json"
    run_tool([guidellm, "run", "--backend", f"kind=openai_http,target={fleet.origin},model={MODEL}",
              "--profile", "kind=constant,rate=2", "--constraint", "kind=max_duration,seconds=8",
              "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
              "--tokenizer", f"kind=huggingface_auto,model={fleet.tokenizer_dir}",
              "--output", f"kind=json,path={report}", "--disable-progress"], tmp_path, timeout=90)

    [benchmark] = json.loads(report.read_text())["benchmarks"]
    assert benchmark["metrics"]["request_totals"]["errored"] == 0, benchmark["requests"]["errored"][:1]
    done = benchmark["requests"]["successful"]
    assert len(done) >= 5, benchmark["metrics"]["request_totals"]  # 2 a second for 8 s
    for request in done:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] and body["ignore_eos"] and body["max_completion_tokens"] == OUTPUT_TOKENS, body
        assert request["output_tokens"] == OUTPUT_TOKENS, request  # the usage graphserve reports, EOS ignored
        assert request["time_to_first_token_ms"] > 0 and request["inter_token_latency_ms"] > 0, request
