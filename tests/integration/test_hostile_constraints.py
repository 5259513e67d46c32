"""Structured-output constraints that no request can weaponise, and protocol aborts that hold: each
scenario as a client outside the project sends it, against a real server on a loopback port.

Before these guards a 13-byte regex froze every stream for 2-7 s (its first token mask ran on the
engine thread), each distinct one kept ~180 MB in the engine process, a grammar that gave up mid-stream
ended as a normal completion, and a compile flood held unrelated requests for 49 s.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as v
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from service.llm import LLM, Constraint, SamplingParams
from service.proto import inference_pb2 as pb
from service.proto import inference_pb2_grpc
from tests.integration.test_vllm_metrics import scrape
from tests.support.server import ServerThread, generate, generate_samples, greedy, running_server

PROMPT = [5, 17, 99, 230, 41, 8]


def hostile_regex(i: int) -> str:
    """13 bytes; a million-character literal whose first mask cost the grammar library 1-3 s of CPU."""
    return "p{1000}{%d}" % (1129 + i)


def hostile_pattern(i: int) -> str:
    """A JSON schema whose string pattern costs the library tens of ms of CPU per token."""
    return json.dumps({"type": "string", "pattern": "^a{1000}{%d}$" % (50 + i)})


def gives_up_grammar(i: int) -> str:
    """2,500 alternatives: the library keeps at most 2,000 items in a row, so it gives up at the first token."""
    return "root ::= " + " | ".join(f'"w{i}x{j}"' for j in range(2500))


def rpc_error(call) -> grpc.RpcError:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def serving(server: ServerThread) -> bool:
    stub = health_pb2_grpc.HealthStub(server.channel())
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def mask_counts(server: ServerThread) -> tuple[float, float]:
    """/metrics' (sat-out, failed) grammar mask rows since the server started."""
    _, samples = scrape(server.app.metrics_port)
    return (samples[("graphserve_constraint_masks_sat_out_total", ())],
            samples[("graphserve_constraint_masks_failed_total", ())])


@pytest.fixture(scope="module")
def hostile_server(model_cache_dir):  # noqa: ANN001, ANN201
    # Up to 8 hostile constraints arrive at once and each is to meet the limit it tests, not the queue's:
    # every waiting request may be compiling (by default half of them may).
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "512", "--max-running-seqs", "16",
                         "--max-waiting-requests", "8", "--max-pending-constraints", "8"]) as server:
        yield server


def test_hostile_constraints_fail_alone_while_other_streams_keep_flowing(hostile_server) -> None:  # noqa: ANN001
    server = hostile_server
    stub = server.stub()
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    gaps: list[float] = []
    victim_tokens: list[int] = []

    def victim() -> None:
        last = None
        for r in stub.Generate(pb.GenerateRequest(**greedy("a victim's story", 200)), timeout=120):
            if r.HasField("chunk"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                victim_tokens.extend(r.chunk.token_ids)

    errors: list[grpc.RpcError] = []
    before = mask_counts(server)

    def hostile(i: int) -> None:
        if i % 3 == 2:  # through vLLM's protocol, as a gateway sends a response_format schema
            call = lambda: list(engine.Generate(v.GenerateRequest(  # noqa: E731
                tokenized=v.TokenizedInput(input_ids=PROMPT),
                sampling_params=v.SamplingParams(max_tokens=40, json_schema=hostile_pattern(i))), timeout=60))
        else:
            call = lambda: list(stub.Generate(pb.GenerateRequest(  # noqa: E731
                text="x", sampling=pb.SamplingParams(regex=hostile_regex(i)),
                stopping=pb.StoppingCriteria(max_tokens=40)), timeout=60))
        errors.append(rpc_error(call))

    threads = [threading.Thread(target=victim)] + [threading.Thread(target=hostile, args=(i,)) for i in range(6)]
    threads[0].start()
    time.sleep(0.3)
    for t in threads[1:]:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert len(errors) == 6
    for e in errors:  # each fails alone, saying what and which limit, never as the server's fault
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert e.details().startswith(("sampling.regex: ", "sampling_params.json_schema: ")), e.details()
        assert "--constraint-" in e.details() or "gave up" in e.details(), e.details()
    assert len(victim_tokens) == 200
    # The victim's longest gap: 2-7 s per hostile request before (its first mask on the engine thread);
    # 78-146 ms measured now on a loaded 2-core host with 4 victims and 8 hostile requests
    # (bench/hostile_constraints.py). 1 s separates the two.
    assert max(gaps) < 1.0, max(gaps)
    assert serving(server)
    # What clients saw, an operator sees: a request failed by its step's mask budget counts once, and
    # the late mask before it sat a step out
    after = mask_counts(server)
    timeouts = sum("--constraint-mask-timeout-ms" in e.details() for e in errors)
    assert after[1] - before[1] == timeouts, (before, after, [e.details() for e in errors])
    assert after[0] - before[0] >= min(1, timeouts), (before, after)


def test_engine_memory_returns_after_distinct_hostile_constraints(hostile_server) -> None:  # noqa: ANN001
    server = hostile_server
    stub = server.stub()
    pid = server.app.engine.process.pid
    generate(stub, text="warm", sampling=pb.SamplingParams(regex="[a-z]{1,8}"), stopping=pb.StoppingCriteria(max_tokens=8))
    time.sleep(2)
    start = rss_mb(pid)
    for i in range(16):
        sampling = [pb.SamplingParams(regex=hostile_regex(100 + i)), pb.SamplingParams(json_schema=hostile_pattern(100 + i)),
                    pb.SamplingParams(grammar=gives_up_grammar(100 + i))][i % 3]
        e = rpc_error(lambda s=sampling: list(stub.Generate(pb.GenerateRequest(
            text="x", sampling=s, stopping=pb.StoppingCriteria(max_tokens=40)), timeout=60)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
    time.sleep(3)  # freed grammar memory is given back within a second or two
    # Before: ~180 MB kept per distinct hostile regex. Now: +15-16 MB after 100 of them with the engine's two
    # malloc arenas, +42-67 MB with glibc's default (bench/results/cpu-20261205-hostile/arena-cap); the bound is
    # the target's.
    assert rss_mb(pid) - start < 50, (start, rss_mb(pid))


def test_a_grammar_that_gives_up_is_an_error_never_a_finish(hostile_server, model_cache_dir) -> None:  # noqa: ANN001
    server = hostile_server
    e = rpc_error(lambda: generate(server.stub(), text="x", sampling=pb.SamplingParams(grammar=gives_up_grammar(0)),
                                   stopping=pb.StoppingCriteria(max_tokens=20)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "gave up" in e.details() and "2000" in e.details()
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    e = rpc_error(lambda: list(engine.Generate(v.GenerateRequest(
        tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=v.SamplingParams(
            max_tokens=20, grammar=gives_up_grammar(1))), timeout=60)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("sampling_params.grammar: ")
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=256, device="cpu",
             dtype="float32") as llm:
        with pytest.raises(ValueError, match="gave up"):
            llm.generate(["x"], SamplingParams(max_tokens=20, constraint=Constraint("regex", hostile_regex(7))))
        [out] = llm.generate(["x"], SamplingParams(max_tokens=8, constraint=Constraint("regex", "[ab]{3}")))
        assert out.outputs[0].text in {a + b + c for a in "ab" for b in "ab" for c in "ab"}


@pytest.mark.parametrize(("sampling", "flag"), [
    (pb.SamplingParams(choice=pb.Choices(choices=[f"c{j}" for j in range(150_000)])), "--max-constraint-choices"),
    (pb.SamplingParams(regex="a" * 100_000), "--max-constraint-bytes"),
    (pb.SamplingParams(json_schema='{"type":"object","properties":{"a":' * 700 + "{}" + "}}" * 700),
     "--max-constraint-depth"),
])
def test_oversized_constraints_are_refused_before_any_compile(hostile_server, sampling, flag) -> None:  # noqa: ANN001
    e = rpc_error(lambda: generate(hostile_server.stub(), text="x", sampling=sampling))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and flag in e.details(), e.details()


def test_a_deep_json_schema_is_invalid_argument_on_every_way_in(hostile_server, model_cache_dir) -> None:  # noqa: ANN001
    deep = '{"type":"object","properties":{"a":' * 1000 + '{"type":"string"}' + "}}" * 1000  # valid, 50 KB
    engine = vllm_engine_pb2_grpc.VllmEngineStub(hostile_server.channel())
    e = rpc_error(lambda: list(engine.Generate(v.GenerateRequest(
        tokenized=v.TokenizedInput(input_ids=PROMPT), sampling_params=v.SamplingParams(max_tokens=4, json_schema=deep)),
        timeout=60)))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-constraint-depth" in e.details()
    with LLM(model="builtin:tiny", model_cache_dir=model_cache_dir, max_running_seqs=4, max_seq_len=256, device="cpu",
             dtype="float32") as llm, pytest.raises(ValueError, match="--max-constraint-depth"):
        llm.generate(["x"], SamplingParams(constraint=Constraint("json_schema", deep)))


def test_a_compile_flood_leaves_unrelated_requests_served(hostile_server) -> None:  # noqa: ANN001
    stub = hostile_server.stub()
    statuses: list[grpc.StatusCode] = []

    def flood(i: int) -> None:
        try:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex=hostile_regex(200 + i)),
                                                  stopping=pb.StoppingCriteria(max_tokens=40)), timeout=60))
            statuses.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            statuses.append(e.code())

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    chunks, finished = generate(stub, **greedy("an unrelated question", 4))
    # Before: 22 ms unloaded, 49 s behind a flood of compiles. Now compiles run beside serving, at a
    # lower priority; 83-175 ms measured under 8 concurrent hostile compiles (bench/hostile_constraints.py).
    assert time.monotonic() - t0 < 5.0 and finished.usage.completion_tokens == 4
    for t in threads:
        t.join(60)
    assert statuses and all(code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
                            for code in statuses), statuses


def test_sigterm_exits_within_its_timeouts_while_compiles_run(process_factory) -> None:  # noqa: ANN001
    server = process_factory("--drain-timeout", "2", "--engine-stop-timeout", "2", "--max-seq-len", "256")
    server.wait_for_health(health_pb2.HealthCheckResponse.SERVING)
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(server.address))

    def hostile(i: int) -> None:
        try:
            list(stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingParams(regex=hostile_regex(300 + i)),
                                                  stopping=pb.StoppingCriteria(max_tokens=40)), timeout=60))
        except grpc.RpcError:
            pass

    for i in range(6):
        threading.Thread(target=hostile, args=(i,), daemon=True).start()
    time.sleep(0.5)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.wait(30)
    # Before: 63-141 s (compile threads joined at exit). The bound: drain + engine stop + 5 s.
    assert time.monotonic() - t0 < 2 + 2 + 5


def test_vllm_request_ids_are_scoped_to_the_connection(hostile_server) -> None:  # noqa: ANN001
    victim = vllm_engine_pb2_grpc.VllmEngineStub(hostile_server.channel())
    # Another client: its own connection (channels to one target share one unless told otherwise).
    other = vllm_engine_pb2_grpc.VllmEngineStub(grpc.insecure_channel(
        hostile_server.address, options=[("grpc.use_local_subchannel_pool", 1)]))
    request = v.GenerateRequest(request_id="shared-id", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                sampling_params=v.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
                                stream=True)
    call = victim.Generate(request, timeout=120)
    next(call)
    other.Abort(v.AbortRequest(request_ids=["shared-id"]), timeout=10)  # not its stream: ignored
    mine = list(other.Generate(v.GenerateRequest(request_id="shared-id", tokenized=v.TokenizedInput(input_ids=PROMPT),
                                                 sampling_params=v.SamplingParams(temperature=0.0, max_tokens=4)),
                               timeout=60))
    assert mine[-1].complete.finish_reason == "length"  # the id is free on this connection
    rest = list(call)
    assert rest[-1].complete.finish_reason == "length" and rest[-1].complete.completion_tokens == 300


def test_an_abort_while_the_constraint_is_prepared_ends_the_request(hostile_server) -> None:  # noqa: ANN001
    server = hostile_server
    engine = vllm_engine_pb2_grpc.VllmEngineStub(server.channel())
    stub = server.stub()
    # Keep the grammar workers busy so that the next constrained request waits to be prepared.
    for i in range(4):
        threading.Thread(target=lambda i=i: rpc_error(lambda: list(stub.Generate(pb.GenerateRequest(
            text="x", sampling=pb.SamplingParams(regex=hostile_regex(400 + i)),
            stopping=pb.StoppingCriteria(max_tokens=40)), timeout=60))), daemon=True).start()
    call = engine.Generate(v.GenerateRequest(
        request_id="prepared", tokenized=v.TokenizedInput(input_ids=PROMPT), stream=True,
        sampling_params=v.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                                         choice=v.ChoiceConstraint(choices=[f"option {j} " * 5 for j in range(1000)]))),
        timeout=60)
    time.sleep(0.05)
    engine.Abort(v.AbortRequest(request_ids=["prepared"]), timeout=10)
    messages = list(call)
    assert messages[-1].complete.finish_reason == "abort"
    deadline = time.monotonic() + 10
    while (server.app.engine.num_running or server.app.engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.app.engine.num_running == 0 and server.app.engine.num_waiting == 0


def test_n_samples_are_admitted_into_free_slots_or_refused_for_good(model_cache_dir) -> None:  # noqa: ANN001
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256", "--max-running-seqs", "8",
                         "--max-waiting-requests", "4"]) as server:
        # An idle server with 8 free slots: 5 samples fit, though more than 4 could wait.
        _, finished = generate_samples(server.stub(), 5, **greedy("five samples", 4))
        assert [f.usage.completion_tokens for f in finished] == [4] * 5
        e = rpc_error(lambda: generate_samples(server.stub(), 13, **greedy("too many", 4)))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-running-seqs + --max-waiting-requests" in e.details()


def test_a_burst_of_distinct_cheap_constraints_is_served_not_refused(model_cache_dir) -> None:  # noqa: ANN001
    """96 clients, each with its own small regex, at once on an idle server with the default limits: all
    are served. With at most 32 compiles pending, 25-60 of them got RESOURCE_EXHAUSTED on a 2-core host
    though each compiles in a few ms."""
    with running_server(["--model-cache-dir", str(model_cache_dir), "--max-seq-len", "256"]) as server:
        stub = server.stub()
        outcomes: list[str] = []

        def one(i: int) -> None:
            try:
                _, finished = generate(stub, text=f"id {i}", sampling=pb.SamplingParams(regex="[a-z]{1,%d}" % (i + 2)),
                                       stopping=pb.StoppingCriteria(max_tokens=4))
                outcomes.append("OK" if finished.usage.completion_tokens >= 1 else "EMPTY")
            except grpc.RpcError as e:
                outcomes.append(f"{e.code().name}: {e.details()}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(96)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert outcomes == ["OK"] * 96, sorted(set(outcomes))
