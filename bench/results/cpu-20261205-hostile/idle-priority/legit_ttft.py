"""A legitimate JSON-schema request's TTFT (distinct schemas: each compiled) while 4 greedy streams run."""
import json, sys, threading, time, argparse, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))  # the repository
from bench.hostile_constraints import Server, parse_args, send, victim
from service.proto import inference_pb2 as pb, inference_pb2_grpc
import tempfile
args = parse_args(["--victim-tokens", "400"])
server = Server(args, pathlib.Path(tempfile.mkdtemp()))
try:
    stub = inference_pb2_grpc.InferenceStub(server.channel)
    send(stub, pb.SamplingParams(temperature=0.0), 8)
    def schema(i):
        props = {f"f{i}_{j}": {"type": ["integer", "string", "boolean"][j % 3]} for j in range(10)}
        return json.dumps({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    alone = [send(stub, pb.SamplingParams(json_schema=schema(100 + k), temperature=0.0), 4)["first_token_s"] for k in range(8)]
    gaps, spans = [[] for _ in range(4)], []
    ts = [threading.Thread(target=victim, args=(stub, 400, g, spans)) for g in gaps]
    for t in ts: t.start()
    time.sleep(0.5)
    loaded = [send(stub, pb.SamplingParams(json_schema=schema(200 + k), temperature=0.0), 4)["first_token_s"] for k in range(8)]
    for t in ts: t.join()
    med = lambda x: sorted(x)[len(x)//2]
    print(f"legit schema TTFT p50 alone {1000*med(alone):.1f} ms, while 4 streams run {1000*med(loaded):.1f} ms (max {1000*max(loaded):.1f})")
finally:
    server.stop()
