"""Command-line surface of the serving package: `clora serve`."""

from __future__ import annotations

import argparse

from clora.argtypes import port


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common],
        help="run the serving process (vLLM engine with every tenant's adapter, OpenAI-compatible HTTP API)",
        description="Serves the base model and every tenant's newest published adapter over an "
        "OpenAI-compatible HTTP API, hot-swapping versions as they are published. Runs until Ctrl-C/SIGTERM.",
    )
    add_arguments(p)
    p.set_defaults(func=serve)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="address to bind (default: serving.host, 127.0.0.1)")
    parser.add_argument("--port", type=port, default=None, help="port (default: serving.port, 8000)")


def serve(args: argparse.Namespace) -> int:
    from clora.cli import config_from_args
    from serving.__main__ import run

    return run(config_from_args(args, writes_data_dir=True), args.host, args.port, getattr(args, "config_path", None))
