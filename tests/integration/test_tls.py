"""Transport security with certificates generated at test time."""

from __future__ import annotations

import grpc
import pytest

from service.proto import inference_pb2_grpc
from tests.support.certs import make_certs
from tests.support.server import generate, greedy, running_server


@pytest.fixture(scope="module")
def certs(tmp_path_factory):  # noqa: ANN001, ANN201
    return make_certs(tmp_path_factory.mktemp("certs"))


def _secure_stub(server, certs, with_client_cert: bool) -> inference_pb2_grpc.InferenceStub:  # noqa: ANN001
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes() if with_client_cert else None,
        certificate_chain=certs.client_cert.read_bytes() if with_client_cert else None,
    )
    return inference_pb2_grpc.InferenceStub(grpc.secure_channel(f"localhost:{server.app.port}", creds))


def test_tls_server_serves_tls_clients_and_refuses_plaintext(model_cache_dir, certs) -> None:  # noqa: ANN001
    with running_server(["--model-cache-dir", str(model_cache_dir), "--tls-cert", str(certs.server_cert),
                         "--tls-key", str(certs.server_key)]) as server:
        _, finished = generate(_secure_stub(server, certs, with_client_cert=False), **greedy("secure", 3))
        assert finished.usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as info:
            generate(server.stub(), timeout=5, **greedy("plaintext", 3))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(model_cache_dir, certs) -> None:  # noqa: ANN001
    with running_server(["--model-cache-dir", str(model_cache_dir), "--tls-cert", str(certs.server_cert),
                         "--tls-key", str(certs.server_key), "--tls-client-ca", str(certs.ca)]) as server:
        _, finished = generate(_secure_stub(server, certs, with_client_cert=True), **greedy("mtls", 3))
        assert finished.usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as info:
            generate(_secure_stub(server, certs, with_client_cert=False), timeout=5, **greedy("no cert", 3))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
