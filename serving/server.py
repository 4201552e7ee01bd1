"""The gRPC server: settings, start-up (health NOT_SERVING until the model is warm), reflection, shutdown.

    python -m serving --config configs/serve-smollm2.toml [--port 50051] [--host 127.0.0.1]

The `[serve]` table holds the server's settings, the `[engine]` table the engine's (see
`jaxinfer.config.EngineConfig`); command-line flags override the file. Start-up logs the
effective settings. The port is bound before the model loads, so health checks answer at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from jaxinfer.config import EngineConfig, load_engine_config
from jaxinfer.engine.xla_compiles import XLA_COMPILES
from jaxinfer.errors import ConfigError
from jaxinfer.llm import LLM
from jaxinfer.parallel.distributed import ProcessGroup
from jaxinfer.parallel.lockstep import Leader
from jaxinfer.weights import self_test
from jaxinfer.weights.registry import resolve
from serving.disagg import ROLES, PrefillRouter, PrefillService
from serving.metrics import ServerMetrics
from serving.openai_server import HttpFrontEnd
from serving.proto.jaxinfer.v1 import inference_pb2 as pb
from serving.service import InferenceService
from serving.tenants import Tenant, TenantBook, parse_tenants
from serving.worker import EngineWorker

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
KV_CHANNEL = pb.DESCRIPTOR.services_by_name["KVChannel"].full_name
LOOPBACK = ("127.", "localhost:", "[::1]:")


@dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port; -1: no gRPC port (an HTTP-only server: `python -m serving.http`)
    http_port: int = -1  # the OpenAI-compatible HTTP API (serving/openai_routes.py); 0: any free port; -1: off
    max_queued: int = 1024  # requests waiting to start beyond engine.max_seqs running; more: RESOURCE_EXHAUSTED
    grace_seconds: float = 30.0  # how long in-flight requests may finish on shutdown
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9090  # Prometheus /metrics; 0: any free port; -1: off
    auth: bool = False  # require `authorization: Bearer <api key>` of a configured tenant
    tenants: tuple[Tenant, ...] = ()  # [[serve.tenants]] entries, plus those of tenants_file
    tenants_file: str = ""  # a TOML file of [[tenants]] entries (keep keys out of the main config)
    tls_cert: str = ""  # PEM paths; both set: TLS on the gRPC port
    tls_key: str = ""
    role: str = "both"  # both | prefill | decode (serving/disagg.py); prefill and decode need engine.kv_store
    prefill_peers: tuple[str, ...] = ()  # a decode worker's prefill workers, "host:port"
    prefill_timeout_seconds: float = 60.0  # a decode worker waits this long for a peer, then tries the next
    prefill_tls_ca: str = ""  # PEM root certificates: TLS to the prefill peers (set it when they use serve.tls_cert)
    self_test: bool = True  # before SERVING, run the checkpoint's stored greedy prompt (jaxinfer/weights/self_test.py)

    def replace(self, **changes: Any) -> ServeConfig:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown serve setting(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


def load_configs(path: str | Path | None, **overrides: Any) -> tuple[ServeConfig, EngineConfig]:
    """The `[serve]` and `[engine]` tables of a TOML file, with non-None overrides applied to `[serve]`."""
    serve: dict[str, Any] = {}
    if path is not None:
        try:
            serve = tomllib.loads(Path(path).read_text()).get("serve", {})
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML ({exc})") from None
    serve.update({k: v for k, v in overrides.items() if v is not None})
    entries = list(serve.pop("tenants", []))
    if serve.get("tenants_file"):
        try:
            entries += tomllib.loads(Path(serve["tenants_file"]).read_text()).get("tenants", [])
        except (FileNotFoundError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"serve.tenants_file: {exc}") from None
    peers = tuple(serve.pop("prefill_peers", ()))
    config = ServeConfig().replace(**serve, tenants=tuple(parse_tenants(entries)), prefill_peers=peers)
    if config.auth and not config.tenants:
        raise ConfigError("serve.auth is on but no tenants are configured")
    if isinstance(config.max_queued, bool) or not isinstance(config.max_queued, int) or config.max_queued < 1:
        raise ConfigError(f"serve.max_queued must be a whole number >= 1, got {config.max_queued!r}")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("serve.tls_cert and serve.tls_key must be set together")
    engine = load_engine_config(path)
    check_role(config, engine)
    return config, engine


def check_role(config: ServeConfig, engine: EngineConfig) -> None:
    if config.role not in ROLES:
        raise ConfigError(f"serve.role must be one of {', '.join(ROLES)}, got {config.role!r}")
    if config.role != "both" and not (engine.kv_store and engine.prefix_caching):
        raise ConfigError(f"serve.role {config.role!r} needs engine.kv_store (the KV store both workers share) "
                          "and engine.prefix_caching")
    if config.http_port >= 0 and config.role != "both":
        raise ConfigError(f"serve.http_port: the HTTP API is served by role 'both' only, not {config.role!r}")
    if config.port < 0 and config.http_port < 0:
        raise ConfigError("serve.port and serve.http_port are both off (-1): the server would serve nothing")
    if (config.role == "decode") != bool(config.prefill_peers):
        raise ConfigError("serve.prefill_peers must be set for role 'decode', and only for it")
    timeout = config.prefill_timeout_seconds
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        raise ConfigError(f"serve.prefill_timeout_seconds must be a positive number of seconds, got {timeout!r}")
    if config.prefill_tls_ca and not Path(config.prefill_tls_ca).is_file():
        raise ConfigError(f"serve.prefill_tls_ca: no such file: {config.prefill_tls_ca}")


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread. Unlike `asyncio.to_thread`, whose executor is joined when the event
    loop closes, a shutdown does not wait for it: a SIGTERM during a minutes-long load ends at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="jaxinfer-load", daemon=True).start()
    return await future


class InferenceServer:
    """One model behind a gRPC port; `llm` may be given (already loaded) instead of loaded from the config."""

    def __init__(self, config: ServeConfig, engine_config: EngineConfig | None = None, llm: LLM | None = None,
                 process_group: ProcessGroup | None = None, lockstep: Leader | None = None):
        """`process_group` and `lockstep`: this server is the leader of a multi-host group (see `LLM`)."""
        self.config, self.engine_config, self.llm = config, engine_config or EngineConfig(), llm
        self.process_group, self.lockstep = process_group, lockstep
        check_role(config, llm.config if llm is not None else self.engine_config)
        self.health = HealthServicer()
        self.metrics = ServerMetrics(self._engine_snapshot)
        self.service = InferenceService(config.model, TenantBook(list(config.tenants), config.auth), self.metrics)
        prefills = config.role == "prefill"
        self.prefill = PrefillService(self.service) if prefills else None
        self.worker: EngineWorker | None = None
        self._not_serving: asyncio.Future | None = None  # health's switch to NOT_SERVING when the engine dies
        self._compiles_at_serving = 0  # XLA_COMPILES when serving began
        self._server: grpc.aio.Server | None = None  # created in `start`, on the serving event loop
        self.http = HttpFrontEnd(self.service, config.host, config.http_port) if config.http_port >= 0 else None
        self.port = 0
        self.http_port: int | None = None
        self.metrics_port: int | None = None

    async def start(self) -> int:
        """Binds the ports and answers health checks at once (NOT_SERVING); returns the gRPC port (-1: none)."""
        if self.http is not None:
            self.http_port = await self.http.start()
        if self.config.port >= 0:
            await self._start_grpc()
        else:
            self.port = -1
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
        auth = f"{len(self.config.tenants)} tenants" if self.config.auth else "OFF (local use: no API keys checked)"
        log.info("listening on %s: gRPC port %d, HTTP port %s (role %s, TLS %s, authentication %s, metrics port %s)",
                 self.config.host, self.port, self.http_port, self.config.role,
                 "on" if self.config.tls_cert else "off", auth, self.metrics_port)
        return self.port

    async def _start_grpc(self) -> None:
        self._server = grpc.aio.server()
        self.service.register(self._server)
        if self.prefill is not None:
            self.prefill.register(self._server)
        if self.config.role == "decode":  # channels are made on the serving event loop
            self.service.router = self._prefill_router()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        services = (SERVICE_NAME, KV_CHANNEL) if self.prefill else (SERVICE_NAME,)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME, "grpc.health.v1.Health"),
                                            self._server)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes())])
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()

    def _prefill_router(self) -> PrefillRouter:
        config = self.config
        tls_ca = Path(config.prefill_tls_ca).read_bytes() if config.prefill_tls_ca else None
        if tls_ca is None and config.auth and not all(peer.startswith(LOOPBACK) for peer in config.prefill_peers):
            log.warning("serve.prefill_tls_ca is not set: API keys go to the prefill peers in plaintext")
        return PrefillRouter(config.prefill_peers, config.prefill_timeout_seconds, tls_ca)

    def _engine_snapshot(self) -> tuple[dict[str, float], int, int] | None:
        if self.worker is None:
            return None
        metrics = {**self.worker.engine.metrics(), **self.service.tenants.held(),
                   "held_streams": self.worker.num_streams, "held_calls": self.service.active}
        return metrics, self.llm.num_compiles, XLA_COMPILES.since(self._compiles_at_serving)

    async def load(self) -> None:
        """Loads and warms the model (unless given), starts the engine thread, then reports SERVING."""
        if self.llm is None:
            self.llm = await in_daemon_thread(lambda: LLM(self.config.model, self.engine_config,
                                                          process_group=self.process_group, lockstep=self.lockstep))
        if self.config.self_test and not await in_daemon_thread(self._self_test):
            return
        # The worker's own engine: only its thread steps it. It shares the runner (device caches, page
        # pool) with `llm.engine`, which must not be stepped from another thread while this serves.
        engine = self.llm.new_engine()
        self._compiles_at_serving = XLA_COMPILES.mark()  # before a scrape can see the worker
        loop = asyncio.get_running_loop()
        self.worker = EngineWorker(engine, self.config.max_queued,
                                   on_dead=lambda _: loop.call_soon_threadsafe(self._report_not_serving))
        self.worker.start()
        self.service.attach(self.llm, self.worker)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s", self.config.model)

    def _self_test(self) -> bool:
        """The checkpoint's fingerprint test (on `llm.engine`, before the worker exists); False: it failed
        and the server stays NOT_SERVING, refusing calls with the reason."""
        passed, message = self_test.check(self.llm, resolve(self.config.model).path)
        (log.info if passed else log.error)(message)
        if not passed:
            self.service.not_ready = message
        return passed

    def _report_not_serving(self) -> None:
        """The engine thread died: health checks say NOT_SERVING, so load balancers route elsewhere."""
        async def report() -> None:
            for service in ("", SERVICE_NAME):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._not_serving = asyncio.ensure_future(report())  # kept: the loop holds tasks only weakly

    async def stop(self) -> None:
        """Refuses new requests, lets in-flight ones finish within the grace period, then stops."""
        self.service.draining = True
        await self.health.enter_graceful_shutdown()
        deadline = asyncio.get_running_loop().time() + self.config.grace_seconds
        while self.service.active and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.worker is not None:
            self.worker.stop()
        if self.lockstep is not None:  # after the engine thread: no step is sent after `stop`
            self.lockstep.stop()
        if self.service.router is not None:
            await self.service.router.close()
        self.metrics.close()

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
