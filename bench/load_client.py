"""The serving load's requests and its client: a chat-like workload (prompt and output lengths
log-normal, random token ids, an optional shared prefix, an optional share of requests whose output
follows a JSON schema) and a grpc.aio client that sends them at their arrival times and records when
each message arrives and how many tokens it carries."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from typing import Any, NamedTuple

from bench.serve_bench import Trace, closed_loop, vocab_size
from service.telemetry.gc_pauses import freeze_startup_heap


class Item(NamedTuple):
    prompt: list[int]  # token ids
    output_tokens: int
    constrained: bool = False  # the output follows SCHEMA


# What a structured-output user asks for: an object with a few typed fields, one of them a list.
SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]})


def lengths(n: int, median: int, sigma: float, cap: int, rng: random.Random) -> list[int]:
    return [max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def workload(args: argparse.Namespace, n: int, seed: int) -> list[Item]:
    """n requests; which of them are constrained is drawn apart from the rest, so that the same seed
    gives the same prompts and lengths at every --constrained-share."""
    rng = random.Random(seed)
    vocab = vocab_size(args)
    prompts = lengths(n, args.prompt_median, args.sigma, args.max_prompt, rng)
    outputs = lengths(n, args.output_median, args.sigma, args.max_output, rng)
    shared = [random.Random(args.seed + 99).randrange(3, vocab - 300) for _ in range(args.shared_prefix)]
    picks = random.Random(seed + 555)
    constrained = [picks.random() < args.constrained_share for _ in range(n)]
    return [Item(shared + [rng.randrange(3, vocab - 300) for _ in range(p)], o, c)
            for p, o, c in zip(prompts, outputs, constrained)]


_STREAMS_PER_CONNECTION = 32


async def _one(stub: Any, pb: Any, item: Item, trace: Trace) -> None:
    sampling = pb.SamplingParams(temperature=0.0, json_schema=SCHEMA) if item.constrained \
        else pb.SamplingParams(temperature=0.0)  # a constrained output also ends where its schema does
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=item.prompt), sampling=sampling,
                                 stopping=pb.StoppingCriteria(max_tokens=item.output_tokens, ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=600):
            if response.WhichOneof("kind") == "chunk" and response.chunk.token_ids:
                trace.chunks.append((time.perf_counter(), len(response.chunk.token_ids)))
    except Exception as exc:  # noqa: BLE001 - recorded per request
        trace.error = f"{type(exc).__name__}: {exc}"
    trace.done = time.perf_counter()


async def _drive(address: str, items: list[Item], offsets: list[float],
                 concurrency: int) -> tuple[list[Trace], float]:
    import grpc

    from service.proto import inference_pb2 as pb
    from service.proto import inference_pb2_grpc

    # Connections of at most _STREAMS_PER_CONNECTION streams each, as a gateway opens them (one
    # connection may hold at most half of the server's --max-concurrent-streams, and 100 by default).
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, math.ceil(concurrency / _STREAMS_PER_CONNECTION)))]
    stubs = itertools.cycle([inference_pb2_grpc.InferenceStub(c) for c in channels])
    try:
        return await closed_loop(items, offsets, argparse.Namespace(concurrency=concurrency),
                                 lambda item, trace: _one(next(stubs), pb, item, trace))
    finally:
        for channel in channels:
            await channel.close()


def drive(address: str, items: list[Item], offsets: list[float]) -> tuple[list[Trace], float]:
    freeze_startup_heap()  # a full collection here would delay the receive times it records
    return asyncio.run(_drive(address, items, offsets, concurrency=len(items)))
