"""`graphserve`: the service's command line. `graphserve serve [flags]` runs the server."""

from __future__ import annotations

import argparse
import asyncio
import sys

import structlog

from service.config import ConfigError, build_parser, load_config
from service.telemetry.log import configure_logging


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = argparse.ArgumentParser(prog="graphserve", description="LLM inference over gRPC with lazy CUDA graphs.")
    top.add_argument("command", choices=["serve", "generate", "gateway"],
                     help="serve: run the gRPC server (`graphserve serve --help`); generate: stream a completion; "
                          "gateway: replicas behind smg, an OpenAI-compatible endpoint (`graphserve gateway --help`)")
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        build_parser().print_help() if argv else None
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "generate":
        from service.client import main as generate_main

        return generate_main(rest)
    if command == "gateway":
        from service.gateway import main as gateway_main

        return gateway_main(rest)
    if command != "serve":
        top.error(f"unknown command {command!r}")
    try:
        config = load_config(rest)
    except ConfigError as exc:
        print(f"graphserve: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    structlog.get_logger("graphserve").info("config", **config.redacted())
    from service.server.app import App  # heavy imports (torch) after the flags are known good
    from service.server.gil import shorten_switch_interval

    shorten_switch_interval()
    return asyncio.run(App(config).run())
