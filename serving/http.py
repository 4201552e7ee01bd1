"""`python -m serving.http --config configs/serve-smollm2.toml [--port 8000]`: the OpenAI-compatible HTTP server.

The same server as `python -m serving` (one engine worker, the same tenants, limits, guard, metrics
and drain), with the HTTP API on `--port` (default: `serve.http_port` of the config, else 8000) and
no gRPC port unless `--grpc-port` asks for one. /metrics is on the HTTP port, so the separate
Prometheus port is off unless `--metrics-port` is given. `python -m serving --http-port P` (or
`serve.http_port`) serves both APIs from one process instead.
"""

from __future__ import annotations

import argparse
import sys

from jaxinfer.errors import JaxinferError
from serving.__main__ import add_arguments, configure_logging, run
from serving.server import load_configs

DEFAULT_HTTP_PORT = 8000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m serving.http", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--grpc-port", type=int, default=-1, help="also serve gRPC on this port (-1: off)")
    args = parser.parse_args(argv)
    if args.http_port is not None:
        parser.error("--http-port: this command's HTTP port is --port")
    http_port = args.port
    if http_port is None:
        configured = load_configs(args.config)[0].http_port
        http_port = configured if configured >= 0 else DEFAULT_HTTP_PORT
    args.port, args.http_port = args.grpc_port, http_port
    if args.metrics_port is None:
        args.metrics_port = -1
    return args


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    try:
        args = parse_args(argv)
    except JaxinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    run(args)


if __name__ == "__main__":
    main()
