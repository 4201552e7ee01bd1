"""`python -m serving --config configs/serve-smollm2.toml [--host H] [--port P] [--model M]`: run the gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys

from jaxinfer.errors import JaxinferError
from jaxinfer.llm import LLM, check_group_settings
from jaxinfer.parallel.distributed import ProcessGroup, initialize
from jaxinfer.parallel.lockstep import Follower, Leader, LeaderStopped, connect
from serving.server import InferenceServer, load_configs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
                         ).parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--config", default=None, help="TOML file with [serve] and [engine] tables")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--http-port", type=int, default=None,
                   help="the OpenAI-compatible HTTP API beside gRPC (0: any free port, -1: off; "
                   "default serve.http_port)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0: any free port, -1: off)")
    p.add_argument("--coordinator", default=None, help="multi-host: HOST:PORT of process 0's coordination "
                   "service, or auto (TPU pod slices); default $JAXINFER_COORDINATOR")
    p.add_argument("--num-processes", type=int, default=None, help="multi-host: processes in the group")
    p.add_argument("--process-id", type=int, default=None,
                   help="multi-host: this process (0 serves gRPC; the others replay its steps)")
    return p


async def serve(args: argparse.Namespace) -> bool:
    """Serves until SIGTERM or SIGINT; True when that came while the model was still loading."""
    config, engine_config = load_configs(args.config, host=args.host, port=args.port, model=args.model,
                                         metrics_port=args.metrics_port, http_port=args.http_port)
    logging.getLogger(__name__).info("settings %s", json.dumps(
        {"serve": dataclasses.asdict(config), "engine": dataclasses.asdict(engine_config)}))
    group = initialize(ProcessGroup.resolve(args.coordinator, args.num_processes, args.process_id))
    if not group.distributed:  # before the port is bound; a group checks in LLM, with every process joined
        check_group_settings(engine_config, group)
    channel = await asyncio.to_thread(connect, group)
    if isinstance(channel, Follower):
        for sig in (signal.SIGTERM, signal.SIGINT):  # a follower ends when its leader says so (or is lost)
            signal.signal(sig, signal.SIG_IGN)
        await asyncio.to_thread(follow, config.model, engine_config, group, channel)
        return False
    try:
        return await serve_as_leader(config, engine_config, group, channel)
    finally:
        if channel is not None:
            channel.stop()


async def serve_as_leader(config, engine_config, group: ProcessGroup, channel: Leader | None) -> bool:
    """The gRPC server (process 0 of a group, or the only process) until SIGTERM or SIGINT; True when
    the signal came while the model was still loading."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the port is announced: a signal right after is ours
        loop.add_signal_handler(sig, stopping.set)
    server = InferenceServer(config, engine_config, process_group=group, lockstep=channel)
    port = await server.start()
    print(json.dumps({"event": "listening", "host": config.host, "port": port, "http_port": server.http_port,
                      "metrics_port": server.metrics_port}), flush=True)
    load = asyncio.create_task(server.load())
    load.add_done_callback(lambda task: task.cancelled() or task.exception() is None or stopping.set())
    await stopping.wait()
    if load.done() and not load.cancelled() and load.exception() is not None:
        await server.stop()
        raise LoadFailed(f"loading {config.model} failed: {load.exception()}")
    loading = not load.done()
    load.cancel()
    await server.stop()
    return loading


def follow(model: str, engine_config, group: ProcessGroup, channel: Follower) -> None:
    """A follower process: the same model on its chips, replaying the leader's steps until it stops."""
    try:
        llm = LLM(model, engine_config, process_group=group, lockstep=channel)
    except LeaderStopped:
        return
    steps = llm.serve_follower()
    logging.getLogger(__name__).info("process %d: the leader stopped after %d steps", group.process_id, steps)


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
    run(parse_args(argv))


def run(args: argparse.Namespace) -> None:
    """Serves until a signal; exits with code 2 on a settings or load error."""
    try:
        stopped_while_loading = asyncio.run(serve(args))
    except JaxinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    if stopped_while_loading:
        # The load thread is inside XLA (reading weights, compiling): no request was taken, so there is
        # nothing to drain, and an interpreter shutdown would wait for that thread or crash under it.
        logging.getLogger(__name__).info("stopped while the model was loading; exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
