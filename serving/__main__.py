"""`python -m serving --config configs/serve-smollm2.toml [--host H] [--port P] [--model M]`: run the gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys

from jaxinfer.errors import JaxinferError
from serving.server import InferenceServer, load_configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="TOML file with [serve] and [engine] tables")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0: any free port, -1: off)")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    config, engine_config = load_configs(args.config, host=args.host, port=args.port, model=args.model,
                                         metrics_port=args.metrics_port)
    logging.getLogger(__name__).info("settings %s", json.dumps(
        {"serve": dataclasses.asdict(config), "engine": dataclasses.asdict(engine_config)}))
    server = InferenceServer(config, engine_config)
    port = await server.start()
    print(json.dumps({"event": "listening", "host": config.host, "port": port,
                      "metrics_port": server.metrics_port}), flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    load = asyncio.create_task(server.load())
    load.add_done_callback(lambda task: task.cancelled() or task.exception() is None or stopping.set())
    await stopping.wait()
    if load.done() and not load.cancelled() and load.exception() is not None:
        await server.stop()
        raise LoadFailed(f"loading {config.model} failed: {load.exception()}")
    load.cancel()
    await server.stop()


class LoadFailed(JaxinferError):
    """The model could not be loaded; the server exits with code 2."""


def configure_logging() -> None:
    """Human-readable logs on stderr; the per-request log (`jaxinfer.requests`) as one JSON object per line."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    requests = logging.getLogger("jaxinfer.requests")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    requests.addHandler(handler)
    requests.propagate = False


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    try:
        asyncio.run(serve(parse_args(argv)))
    except JaxinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
