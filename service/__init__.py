"""graphserve: LLM inference over gRPC with a continuous-batching engine and a lazy CUDA-graph cache.

The Python API (`from service import LLM, SamplingParams`) is imported on first use, so that the
command-line tools that do not need torch (graphctl) still start fast.
"""

from typing import Any

__all__ = ["LLM", "Completion", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from service import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'service' has no attribute {name!r}")
