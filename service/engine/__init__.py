"""The continuous-batching engine: requests, scheduler, runner, sampler, stops, detokenization."""
