"""`llmplug proxy --prefill URL --decode URL`: one address for a prefill engine and a decode engine (the app is in
disagg_proxy.py, imported only when the command runs)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, help="base URL of the kv_producer engine, e.g. http://host:8100")
    parser.add_argument("--decode", required=True, help="base URL of the kv_consumer engine, e.g. http://host:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one engine call may take")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from llmplug.entrypoints.disagg_proxy import build_proxy_app

    uvicorn.run(build_proxy_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout),
                host=args.host, port=args.port, log_level="info")
    return 0
