"""`graphserve generate`: stream one completion from a running server to the terminal."""

from __future__ import annotations

import argparse
import sys

import grpc

from service.proto import inference_pb2, inference_pb2_grpc

_REASONS = {v.number: v.name.removeprefix("FINISH_REASON_").lower()
            for v in inference_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"].values}


def build_parser() -> argparse.ArgumentParser:
    from service.config import HelpFormatter

    p = argparse.ArgumentParser(prog="graphserve generate", description="Stream a completion from a server.",
                                formatter_class=HelpFormatter)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message, rendered with the model's chat template")
    p.add_argument("--system", default=None, help="a system message before the prompt (implies --chat)")
    p.add_argument("--target", default="127.0.0.1:50051", help="the server's gRPC address")
    p.add_argument("--max-tokens", type=int, default=64, help="completion tokens at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: off")
    p.add_argument("--seed", type=int, default=None, help="a seed for a repeatable sample (default: random)")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole call")
    p.add_argument("--adapter", default="", help="a loaded LoRA adapter's name (default: the base model)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sampling = inference_pb2.SamplingParams(temperature=args.temperature, top_k=args.top_k)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    if args.chat or args.system is not None:
        turns = [("system", args.system)] if args.system is not None else []
        turns.append(("user", args.prompt))
        prompt = {"messages": inference_pb2.ChatMessages(
            messages=[inference_pb2.ChatMessage(role=role, content=content) for role, content in turns])}
    else:
        prompt = {"text": args.prompt}
    request = inference_pb2.GenerateRequest(
        **prompt,
        sampling=sampling,
        stopping=inference_pb2.StoppingCriteria(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos),
        adapter=args.adapter,
    )
    with grpc.insecure_channel(args.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, wait_for_ready=False):
                if response.WhichOneof("kind") == "chunk":
                    sys.stdout.write(response.chunk.text)
                    sys.stdout.flush()
                else:
                    f = response.finished
                    print(f"\n[{_REASONS.get(f.finish_reason, '?')}: {f.usage.prompt_tokens} prompt + "
                          f"{f.usage.completion_tokens} completion tokens, first token after "
                          f"{f.timings.time_to_first_token_seconds * 1000:.1f} ms, total "
                          f"{f.timings.total_seconds * 1000:.1f} ms]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"graphserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
