"""The HTTP front end's lifecycle: uvicorn serving the OpenAI app on the gRPC server's event loop.

The socket is bound before the model loads (so /health answers 503 at once, and port 0 gives a
free port that is known before serving starts); `stop` lets uvicorn finish the responses in flight
after the gRPC server's drain, so one grace period covers both front ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from serving.openai_routes import OpenAIFrontEnd
from serving.service import InferenceService

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gRPC server's process owns SIGTERM and SIGINT."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpFrontEnd:
    def __init__(self, service: InferenceService, host: str, port: int):
        self.routes = OpenAIFrontEnd(service)
        self.host, self.requested_port = host, port
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Binds the port and starts serving; returns the port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.requested_port))
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.routes.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=5)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: raise its error
                await self._task
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        await self._task
