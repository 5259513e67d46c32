"""A legitimate JSON-schema request's TTFT (distinct schemas: each compiled) alone and while 4 greedy
streams run. Run from the repository root: python bench/results/cpu-20261205-hostile/idle-priority/legit_ttft.py"""

import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))  # the repository

from bench.hostile_constraints import Server, parse_args, send, victim  # noqa: E402
from service.proto import inference_pb2 as pb  # noqa: E402
from service.proto import inference_pb2_grpc  # noqa: E402


def schema(i: int) -> str:
    props = {f"f{i}_{j}": {"type": ["integer", "string", "boolean"][j % 3]} for j in range(10)}
    return json.dumps({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})


def main() -> None:
    server = Server(parse_args(["--victim-tokens", "400"]), pathlib.Path(tempfile.mkdtemp()))
    try:
        stub = inference_pb2_grpc.InferenceStub(server.channel)
        send(stub, pb.SamplingParams(temperature=0.0), 8)
        alone = [send(stub, pb.SamplingParams(json_schema=schema(100 + k), temperature=0.0), 4)["first_token_s"]
                 for k in range(8)]
        gaps: list[list[float]] = [[] for _ in range(4)]
        spans: list[tuple[float, float]] = []
        threads = [threading.Thread(target=victim, args=(stub, 400, g, spans)) for g in gaps]
        for t in threads:
            t.start()
        time.sleep(0.5)
        loaded = [send(stub, pb.SamplingParams(json_schema=schema(200 + k), temperature=0.0), 4)["first_token_s"]
                  for k in range(8)]
        for t in threads:
            t.join()
        print(f"legit schema TTFT p50 alone {1000 * statistics.median_high(alone):.1f} ms, while 4 streams run "
              f"{1000 * statistics.median_high(loaded):.1f} ms (max {1000 * max(loaded):.1f})")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
