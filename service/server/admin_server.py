"""The admin port: GraphCacheAdmin behind a bearer token, on its own gRPC server.

A separate server (not a second port of the inference server) so the admin listener binds to
loopback by default, carries its own interceptor, and stays closed when no token is configured.
"""

from __future__ import annotations

import ipaddress

import grpc
import structlog
from grpc_reflection.v1alpha import reflection

from service.config import ServeConfig
from service.engine_client.client import EngineClient
from service.proto import admin_pb2, admin_pb2_grpc
from service.server.admin_servicer import GraphCacheAdminServicer
from service.server.auth import BearerTokenInterceptor
from service.server.decoding import RequestDecodingInterceptor
from service.server.transport import add_port
from service.telemetry.metrics import Metrics

log = structlog.get_logger("graphserve.admin")

ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["GraphCacheAdmin"].full_name


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


async def start_admin_server(
    config: ServeConfig, engine: EngineClient, metrics: Metrics | None = None,
) -> tuple[grpc.aio.Server | None, int | None]:
    """Start the admin server; returns (server, bound port), or (None, None) when no token is configured.

    The caller stops it with `await server.stop(grace)` at shutdown.
    """
    if not config.admin_token:
        log.info("admin_disabled", reason="no admin token; set --admin-token-file or GRAPHSERVE_ADMIN_TOKEN")
        return None, None
    tls = config.tls_cert is not None
    if not tls and not _is_loopback(config.admin_host):
        log.warning("admin_plaintext", host=config.admin_host,
                    hint="the admin token travels unencrypted; use --tls-cert/--tls-key or a loopback --admin-host")
    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(config.admin_token, metrics.auth_failed if metrics else None),
                      RequestDecodingInterceptor(metrics.undecodable if metrics else None)],
        options=[("grpc.so_reuseport", 0)],
    )
    admin_pb2_grpc.add_GraphCacheAdminServicer_to_server(GraphCacheAdminServicer(engine), server)
    reflection.enable_server_reflection((ADMIN_SERVICE, reflection.SERVICE_NAME), server)
    port = add_port(server, f"{config.admin_host}:{config.admin_port}", config)
    await server.start()
    log.info("admin_listening", address=f"{config.admin_host}:{port}", tls=tls,
             mtls=config.tls_client_ca is not None)
    return server, port
