"""graphserve: LLM inference over gRPC with a continuous-batching engine and a lazy CUDA-graph cache.

The Python API (`from service import LLM, SamplingParams`) is imported on first use, so that the
command-line tools that do not need torch (graphctl) still start fast.
"""

from typing import Any

# name -> its module (vLLM's names: `from service import LLM, SamplingParams` for `from vllm import ...`)
_EXPORTS = {"LLM": "llm", "SamplingParams": "llm", "StructuredOutputsParams": "engine.sampling_params",
            "RequestOutput": "outputs", "CompletionOutput": "outputs", "Logprob": "outputs"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"service.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'service' has no attribute {name!r}")
