"""Fuzzing the request surface against a live server: every call ends OK, INVALID_ARGUMENT or
RESOURCE_EXHAUSTED (never INTERNAL or UNKNOWN), and a normal request succeeds after each batch."""

from __future__ import annotations

import concurrent.futures

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.proto import inference_pb2 as pb
from tests.support.server import generate, greedy

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB_EDGE = st.sampled_from([0, 1, 511, 512, 513, 1023, 1024, 1025, 2**31 - 1, 2**32 - 1])
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1e-30, 1.0, 2.0]))


@st.composite
def requests(draw) -> pb.GenerateRequest:  # noqa: ANN001
    req = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), TEXT.map(lambda t: t[:300]))))
    if draw(st.booleans()):
        req.text = draw(st.one_of(TEXT, st.just("x" * 5000), st.just("")))
    elif draw(st.booleans()):
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 600), VOCAB_EDGE), max_size=40)))
    if draw(st.booleans()):
        req.sampling.temperature = draw(FLOATS)
    if draw(st.booleans()):
        req.sampling.top_p = draw(FLOATS)
    req.sampling.top_k = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        req.sampling.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        req.stopping.max_tokens = draw(st.one_of(st.integers(0, 12), st.sampled_from([2**32 - 1, 10**6, 500])))
    else:
        req.stopping.max_tokens = 4  # keep the run short; the default is exercised elsewhere
    req.stopping.stop.extend(draw(st.lists(TEXT, max_size=20)))
    req.stopping.stop_token_ids.extend(draw(st.lists(st.one_of(st.integers(0, 600), VOCAB_EDGE), max_size=70)))
    req.stopping.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        req.stream_interval = draw(st.one_of(st.integers(0, 8), st.sampled_from([2**32 - 1, 1025])))
    return req


def _code(stub, request: pb.GenerateRequest) -> grpc.StatusCode:  # noqa: ANN001
    try:
        for _ in stub.Generate(request, timeout=60):
            pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(batch=st.lists(requests(), min_size=1, max_size=4))
def test_random_requests_never_break_the_server(server, batch: list[pb.GenerateRequest]) -> None:
    stub = server.stub()
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        codes = list(pool.map(lambda r: _code(stub, r), batch))
    assert set(codes) <= ALLOWED, codes
    _, finished = generate(stub, **greedy("after the fuzz", 3))
    assert finished.usage.completion_tokens == 3


def test_duplicate_request_ids_in_flight_are_invalid_argument(server) -> None:
    stub = server.stub()
    request = pb.GenerateRequest(request_id="same-id", **greedy("Once upon a time", 200))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: _code(stub, request), range(6)))
    assert grpc.StatusCode.OK in codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
