"""A mixture-of-experts built-in model served by a real server on loopback: it streams greedy tokens,
and GetModelInfo, the vLLM protocol's model info, /metrics and `graphctl state` name its architecture."""

from __future__ import annotations

import pytest

from service import graphctl
from service.proto import inference_pb2
from tests.integration.test_vllm_metrics import scrape
from tests.support.server import generate, greedy, running_server

TOKEN = "families-admin-token"
ARCH = "Qwen3MoeForCausalLM"


def test_an_moe_model_is_served_and_named_everywhere(model_cache_dir, tmp_path, capsys) -> None:  # noqa: ANN001
    from smg_grpc_proto.generated import vllm_engine_pb2 as v
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc

    token = tmp_path / "token"
    token.write_text(TOKEN)
    argv = ["--model", "builtin:tiny-qwen3-moe", "--model-cache-dir", str(model_cache_dir), "--max-running-seqs", "8",
            "--max-seq-len", "256"]
    with running_server(argv, environ={"GRAPHSERVE_ADMIN_TOKEN": TOKEN}) as server:
        stub = server.stub()
        info = stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=10)
        assert info.architecture == ARCH and info.model == "builtin:tiny-qwen3-moe"
        vllm_info = vllm_engine_pb2_grpc.VllmEngineStub(server.channel()).GetModelInfo(v.GetModelInfoRequest(),
                                                                                      timeout=10)
        assert list(vllm_info.architectures) == [ARCH]
        _, finished = generate(stub, **greedy("The model routes each token", 8))
        assert finished.usage.completion_tokens == 8
        _, samples = scrape(server.app.metrics_port)
        assert samples[("graphserve_model_info", (("architecture", ARCH), ("model", "builtin:tiny-qwen3-moe")))] == 1
        capsys.readouterr()
        code = graphctl.main(["--target", f"127.0.0.1:{server.app.admin_port}", "--token-file", str(token), "state"])
        out = capsys.readouterr().out
        assert code == 0 and out.splitlines()[0].endswith(f", model {ARCH}")


@pytest.mark.parametrize("flags, message", [(["--max-loras", "2"], "LoRA adapters are not served on mixture-of-experts"),
                                            (["--batch-invariant"], "batch-invariant mode is not served with mixture")])
def test_unsupported_combinations_fail_the_start_by_name(model_cache_dir, flags, message) -> None:  # noqa: ANN001
    argv = ["--model", "builtin:tiny-qwen3-moe", "--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256",
            *flags]
    with pytest.raises(Exception, match=message), running_server(argv):
        pass
