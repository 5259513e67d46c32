"""Bursts of distinct constraints against a running server: `python burst.py cheap|mixed|one-schema N [PORT]`."""

import collections
import json
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from service.proto import inference_pb2 as pb
from service.proto import inference_pb2_grpc

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"]})


def sampling(kind: str, i: int) -> pb.SamplingParams:
    if kind == "cheap":
        return pb.SamplingParams(regex="[a-z]{1,%d}" % (i + 2))
    if kind == "one-schema":
        return pb.SamplingParams(json_schema=SCHEMA)
    properties = {f"k{i}_{j}": {"type": "string", "pattern": "^[a-z]{%d}$" % (j + 1)} for j in range(20)}
    return [pb.SamplingParams(regex="(a|b){%d}c[0-9]{3}" % (5 + i)),
            pb.SamplingParams(json_schema=json.dumps({"type": "object", "properties": properties,
                                                      "required": [f"k{i}_0"]})),
            pb.SamplingParams(regex="p{1000}{%d}" % (2000 + i)),
            pb.SamplingParams(grammar='root ::= "x" [0-9]{%d}' % (i + 1))][i % 4]


def main() -> None:
    kind, n = sys.argv[1], int(sys.argv[2])
    channel = grpc.insecure_channel(f"127.0.0.1:{sys.argv[3] if len(sys.argv) > 3 else 50071}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    outcomes: collections.Counter = collections.Counter()
    messages: set[str] = set()

    def one(i: int) -> None:
        request = pb.GenerateRequest(text=f"id {i}", sampling=sampling(kind, i),
                                     stopping=pb.StoppingCriteria(max_tokens=30))
        try:
            list(stub.Generate(request, timeout=60))
            outcomes["OK"] += 1
        except grpc.RpcError as e:
            outcomes[e.code().name] += 1
            messages.add(f"{e.code().name}: {e.details()[:160]}")

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"burst of {n} ({kind}): {dict(outcomes)} in {time.monotonic() - start:.1f} s")
    for m in sorted(messages):
        print(" ", m)
    time.sleep(2)
    loads = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetLoads(vllm_engine_pb2.GetLoadsRequest())
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    print("after:", str(loads.loads).replace("\n", " "), "health", health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))


if __name__ == "__main__":
    main()
