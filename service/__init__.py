"""graphserve: LLM inference over gRPC with a continuous-batching engine and a lazy CUDA-graph cache."""
