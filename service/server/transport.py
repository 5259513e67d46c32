"""Binding ports: plaintext, TLS, or mutual TLS, from the same flags for every port."""

from __future__ import annotations

import grpc

from service.config import ServeConfig


def server_credentials(config: ServeConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    root = config.tls_client_ca.read_bytes() if config.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())],
        root_certificates=root,
        require_client_auth=root is not None,
    )


def add_port(server: grpc.aio.Server, address: str, config: ServeConfig) -> int:
    """Bind address; returns the port (useful when the config asked for port 0)."""
    credentials = server_credentials(config)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where it used to return 0
        port = 0
    if port == 0:
        raise SystemExit(f"could not bind {address}: is the port in use?")
    return port
