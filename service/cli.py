"""`graphserve`: the service's command line. `graphserve serve [MODEL] [flags]` runs the server."""

from __future__ import annotations

import argparse
import asyncio
import sys

import structlog

from service.config import ConfigError, load_config, version
from service.telemetry import startup
from service.telemetry.log import configure_logging

COMMANDS = {
    "serve": "run the gRPC server (`graphserve serve --help`)",
    "generate": "stream a completion from a running server (`graphserve generate --help`)",
    "gateway": "replicas behind smg: an OpenAI-compatible endpoint (`graphserve gateway --help`)",
}


def _top_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="graphserve", description="LLM inference over gRPC with lazy CUDA graphs.",
                                  epilog="\n".join(f"  {name:9} {text}" for name, text in COMMANDS.items()),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("--version", action="version", version=f"graphserve {version()}")
    top.add_argument("command", choices=list(COMMANDS), help="one of the commands below")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        if not argv:
            top.print_help(sys.stderr)
            return 2
        top.parse_args(argv[:1])  # --help, --version, or an error naming the commands; each exits
    command, rest = argv[0], argv[1:]
    if command == "generate":
        from service.client import main as generate_main

        return generate_main(rest)
    if command == "gateway":
        from service.gateway import main as gateway_main

        return gateway_main(rest)
    startup.record()
    startup.mark("imports")
    try:
        config = load_config(rest)
    except ConfigError as exc:
        print(f"graphserve: {exc}", file=sys.stderr)
        return 2
    from service.engine_client.spawn import start_early
    from service.preflight import check_serve

    start_early()  # its imports overlap the checks' (it loads nothing before the server sends its spec)
    problems = check_serve(config)  # before any port opens or model loads
    for problem in problems:
        print(f"graphserve: {problem}", file=sys.stderr)
    if problems:
        return 2
    configure_logging(config.log_format, config.log_level)
    structlog.get_logger("graphserve").info("config", **config.redacted())
    startup.mark("config")
    from service.engine_client.gil import shorten_switch_interval
    from service.server.app import App  # heavy imports (torch) after the flags are known good

    startup.mark("server_imports")
    shorten_switch_interval()
    return asyncio.run(App(config).run())
