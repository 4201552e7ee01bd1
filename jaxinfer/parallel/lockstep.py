"""Lockstep serving across processes: the leader's step inputs go to every follower, which replays them.

In multi-controller JAX every process must launch the same computations, in the same order, on the
global mesh. Only the leader (process 0) runs the scheduler; before it dispatches a step it sends
that step's host arrays (the small int32/float32 arrays of a `HostBatch`) to every follower over a
TCP control channel, and each follower dispatches the same step on its own chips. Sampled ids are
replicated over the mesh, so the leader reads them from its own devices.

The channel also carries the group's life: the leader sends `stop` when it shuts down and the
followers exit cleanly; a follower that reads end-of-file (the leader died) exits non-zero; the
leader exits non-zero at once when a follower's connection drops, since its next collective would
wait for that follower forever. Followers answer only `load` (ready, or a refusal with its reason);
the leader then sends `go` when all are ready, else `stop`, so no follower starts loading alone and
a refusing follower leaves the coordination service in order with the rest.
The leader publishes its address and a one-time token in the coordination service's key-value
store, so only members of the group can connect.

Frames: 8 bytes (header length, payload length, big-endian), a JSON header, then the arrays' raw
bytes back to back, described by the header (name, dtype, shape). No pickle crosses the wire. A
step's page table goes without its trailing zero columns (`pack_step`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxinfer.errors import ConfigError, JaxinferError
from jaxinfer.parallel.distributed import ProcessGroup, key_value_store

log = logging.getLogger(__name__)

ADDRESS_KEY = "jaxinfer/lockstep/leader"
ENV_CONTROL_HOST = "JAXINFER_CONTROL_HOST"
ENV_CONTROL_PORT = "JAXINFER_CONTROL_PORT"
FOLLOWER_LOST_EXIT = 3  # the leader's exit status when a follower goes away
LEADER_LOST_EXIT = 4  # a follower's exit status when the leader goes away without `stop`
DIVERGED_EXIT = 5  # the leader's exit status when it failed to run a step it had sent
REPLAY_FAILED_EXIT = 6  # a follower's exit status when it failed to replay what the leader sent
HELLO_LIMIT = 4096  # bytes of a follower's hello: anything larger is not one
ANSWER_LIMIT = 1 << 16  # bytes of a follower's answer to `load` (a refusal's reason, JSON-escaped)
REASON_CHARS = 4000  # a refusal's reason is cut to this; JSON escapes a character to at most 12 bytes
KEPT_RESULTS = 8  # a follower keeps this many recent steps' sampled ids (later steps may read them)
_FRAME = struct.Struct(">II")
_connections = 0


class LeaderLost(JaxinferError):
    """The leader's control channel closed without a stop message."""


class LeaderStopped(JaxinferError):
    """The leader stopped before the model was loaded (nothing to replay)."""


class GroupStopped(JaxinferError):
    """A step was asked of a leader whose group has already stopped."""


def _address_key() -> str:
    """A key per connection: every process connects the same number of times, in the same order."""
    global _connections
    _connections += 1
    return f"{ADDRESS_KEY}/{_connections}"


def coordinator_host(group: ProcessGroup) -> str:
    """The leader's address as the group reaches it: the coordinator's host (process 0 runs it)."""
    if group.coordinator_host:
        return group.coordinator_host
    from jax._src import distributed

    address = distributed.global_state.coordinator_address or ""
    return address.rpartition(":")[0].strip("[]") or socket.gethostbyname(socket.gethostname())


def encode(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    header = {**header, "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()]}
    head = json.dumps(header).encode()
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return _FRAME.pack(len(head), len(payload)) + head + payload


def pack_step(number: int, previous: int, arrays: dict[str, np.ndarray]) -> bytes:
    """A step's frame. The page table's trailing all-zero columns (pages no row has reached: most of
    a max_model_len-wide table) are left out and restored by `unpack_step`."""
    table = arrays["page_table"]
    used = np.flatnonzero(table.any(axis=0))
    width = int(used[-1]) + 1 if used.size else 0
    header = {"op": "step", "number": number, "previous": previous, "page_table_width": table.shape[1]}
    return encode(header, {**arrays, "page_table": table[:, :width]})


def unpack_step(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    table = arrays["page_table"]
    full = np.zeros((table.shape[0], header["page_table_width"]), table.dtype)
    full[:, : table.shape[1]] = table
    return {**arrays, "page_table": full}


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(sock: socket.socket, limit: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """One frame: (header, arrays), or None at end of file. ValueError: a frame over `limit` bytes,
    or arrays that do not add up to the payload."""
    prefix = _receive_exactly(sock, _FRAME.size)
    if prefix is None:
        return None
    head_size, payload_size = _FRAME.unpack(prefix)
    if limit is not None and head_size + payload_size > limit:
        raise ValueError(f"control channel: a {head_size + payload_size}-byte frame exceeds {limit} bytes")
    head, payload = _receive_exactly(sock, head_size), _receive_exactly(sock, payload_size)
    if head is None or payload is None:
        return None
    header = json.loads(head)
    arrays, offset = {}, 0
    for name, dtype_text, shape in header.pop("arrays"):
        dtype = np.dtype(dtype_text)
        if dtype.hasobject:
            raise ValueError(f"control channel: array {name} has an object dtype")
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if offset + size > len(payload):
            raise ValueError(f"control channel: array {name} runs past the payload")
        arrays[name] = np.frombuffer(payload, dtype, count=size // dtype.itemsize, offset=offset).reshape(shape)
        offset += size
    if offset != len(payload):
        raise ValueError("control channel: the payload is longer than its arrays")
    return header, arrays


def _exit_now(message: str, status: int) -> None:
    """Ends the process at once: a collective waiting on a lost peer would never return."""
    log.critical(message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(status)


class Leader:
    """Process 0's end: accepts every follower, then sends each step before dispatching it."""

    def __init__(self, group: ProcessGroup, accept_timeout: float = 600.0,
                 on_follower_lost: Callable[[str], None] | None = None):
        self.group = group
        self.answer_timeout = accept_timeout
        self.stopping = False
        self.on_follower_lost = on_follower_lost or (lambda message: _exit_now(message, FOLLOWER_LOST_EXIT))
        self._lock = threading.Lock()
        token = secrets.token_hex(16)
        port = int(os.environ.get(ENV_CONTROL_PORT, "0"))
        dual = socket.has_dualstack_ipv6()
        listener = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                        dualstack_ipv6=dual)
        host = os.environ.get(ENV_CONTROL_HOST) or coordinator_host(group)
        address = f"{host}:{listener.getsockname()[1]}"
        key_value_store().key_value_set(_address_key(), json.dumps({"address": address, "token": token}))
        try:
            self.followers = self._accept(listener, token, accept_timeout)
        finally:
            listener.close()
        atexit.register(self.stop)  # runs before JAX's own exit-time shutdown, which waits for every process
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {process_id: queue.Queue()
                                                                 for process_id in self.followers}
        for process_id, sock in self.followers.items():
            threading.Thread(target=self._watch, args=(process_id, sock), daemon=True,
                             name=f"lockstep-watch-{process_id}").start()
        log.info("lockstep leader at %s with %d followers", address, len(self.followers))

    def _accept(self, listener: socket.socket, token: str, timeout: float) -> dict[int, socket.socket]:
        followers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        expected = set(range(1, self.group.num_processes))
        while set(followers) != expected:
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                missing = sorted(expected - set(followers))
                raise ConfigError(f"followers {missing} did not connect within {timeout:.0f}s") from None
            sock.settimeout(max(0.1, min(30.0, deadline - time.monotonic())))
            try:
                hello = receive(sock, limit=HELLO_LIMIT)
                header = hello[0] if hello else {}
                process_id = header.get("process_id")
                accepted = (header.get("token") == token and isinstance(process_id, int) and process_id in expected
                            and process_id not in followers)
            except (OSError, ValueError, TypeError, AttributeError):  # a probe, a reset, a malformed hello
                accepted = False
            if not accepted:
                log.warning("control channel: refused a connection from %s", peer)
                sock.close()
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            followers[process_id] = sock
        return followers

    def _watch(self, process_id: int, sock: socket.socket) -> None:
        """Queues the follower's answers to `load` until its connection closes, which means it is gone."""
        while True:
            try:
                frame = receive(sock, limit=ANSWER_LIMIT)
            except (OSError, ValueError):
                frame = None
            if frame is None:
                break
            self._answers[process_id].put(frame[0])
        self._answers[process_id].put({"op": "lost"})
        if not self.stopping:
            self.on_follower_lost(f"follower process {process_id} left the group (its control connection "
                                  "closed); the leader stops")

    def _send(self, frame: bytes) -> None:
        with self._lock:
            for process_id, sock in self.followers.items():
                try:
                    sock.sendall(frame)
                except OSError as error:
                    if not self.stopping:
                        self.on_follower_lost(f"follower process {process_id} is unreachable ({error}); "
                                              "the leader stops")

    def begin_load(self, checkpoints: dict[str, Any], settings: dict[str, Any]) -> dict[int, str]:
        """Lets the followers load the model (loading can run collectives, so all load together);
        `checkpoints`: what the leader loads, and `settings` its engine settings, for each follower to
        check it reads the same and runs the same.

        Two phases, so no follower starts loading (which runs collectives) unless all will: every
        follower answers, then the leader sends `go` when all are ready. Returns each refusing
        follower's reason (empty: all load); on refusals the caller stops the group (`stop`)."""
        self._send(encode({"op": "load", "checkpoints": checkpoints, "settings": settings}, {}))
        deadline = time.monotonic() + self.answer_timeout
        refusals = {}
        for process_id, answers in self._answers.items():
            try:
                answer = answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                answer = {"op": "refuse", "reason": f"no answer to load within {self.answer_timeout:.0f}s"}
            if answer.get("op") == "refuse":
                refusals[process_id] = str(answer.get("reason", ""))[:REASON_CHARS]
            elif answer.get("op") != "ready":
                refusals[process_id] = "it left the group before loading"
        if not refusals:
            self._send(encode({"op": "go"}, {}))
        return refusals

    def step(self, number: int, previous: int, arrays: dict[str, np.ndarray]) -> None:
        """Sends step `number` (its inputs; `previous`: the step whose sampled ids it reads, -1: none)."""
        self._send_work(pack_step(number, previous, arrays))

    def call(self, method: str, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Sends device work done outside the step (an adapter load), replayed by `Follower.serve`'s `call`."""
        self._send_work(encode({"op": "call", "method": method, "fields": fields}, arrays))

    def _send_work(self, frame: bytes) -> None:
        if self.stopping:  # the followers are gone: work run alone would wait for them forever
            raise GroupStopped("the process group has stopped; no step or call can run")
        self._send(frame)

    def diverged(self, error: BaseException) -> None:
        """The leader failed to launch a step it had sent: the followers ran it alone, so the group's
        collectives no longer pair up. Nothing can continue."""
        log.critical("the leader failed after sending work to its followers", exc_info=error)
        _exit_now(f"the leader could not do what its followers did ({error!r}); the group stops", DIVERGED_EXIT)

    def stop(self) -> None:
        """Tells every follower to exit; safe to call twice. Followers close their end on `stop`, so
        `stopping` is set first: a close seen while sending to the others is not a lost follower."""
        if self.stopping:
            return
        self.stopping = True
        self._send(encode({"op": "stop"}, {}))
        for sock in self.followers.values():
            sock.close()


class Follower:
    """A follower's end: connects to the leader and replays every step it sends."""

    def __init__(self, group: ProcessGroup, timeout: float = 600.0,
                 on_leader_lost: Callable[[str], None] | None = None):
        self.group = group
        self.on_leader_lost = on_leader_lost or (lambda message: _exit_now(message, LEADER_LOST_EXIT))
        record = key_value_store().blocking_key_value_get(_address_key(), int(timeout * 1000))
        leader = json.loads(record)
        host, _, port = leader["address"].rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.settimeout(None)
        self.sock.sendall(encode({"op": "hello", "process_id": group.process_id, "token": leader["token"]}, {}))
        log.info("follower %d connected to the leader at %s", group.process_id, leader["address"])

    def close(self) -> None:
        """Leaves the group (a follower that failed): the leader sees end-of-file and stops."""
        self.sock.close()

    def await_load(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Waits until the leader loads the model and returns what it loads and its settings
        (`begin_load`'s `checkpoints` and `settings`); raises LeaderStopped if it stops first."""
        header, _ = self._expect("load")
        return header["checkpoints"], header["settings"]

    def answer_load(self, refusal: str = "") -> None:
        """Tells the leader this follower loads (`refusal` empty) or why it does not.

        A ready follower returns on the leader's `go` and raises LeaderStopped on `stop` (another
        follower refused). A refusing follower waits for `stop`, so the group leaves the coordination
        service together instead of the leader exiting under the follower's shutdown."""
        if not refusal:
            self.sock.sendall(encode({"op": "ready"}, {}))
            self._expect("go")
            return
        self.sock.sendall(encode({"op": "refuse", "reason": refusal[:REASON_CHARS]}, {}))
        while self._receive()[0]["op"] != "stop":
            pass
        self.sock.close()

    def replay_next_call(self, call: Callable[[str, dict[str, Any], dict[str, np.ndarray]], None]) -> None:
        """Replays the next message, which must be a call (the leader loading what its config names)."""
        header, arrays = self._expect("call")
        call(header["method"], header["fields"], arrays)

    def _expect(self, op: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The next message while the model loads, which must be `op`; LeaderStopped on `stop`."""
        header, arrays = self._receive()
        if header["op"] == "stop":
            self.sock.close()
            raise LeaderStopped(f"the leader stopped while this follower waited for {op}")
        if header["op"] != op:
            raise LeaderLost(f"control channel: expected {op}, got {header['op']}")
        return header, arrays

    def _receive(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        frame = receive(self.sock)
        if frame is None:
            self.on_leader_lost(f"follower {self.group.process_id}: the leader's control connection "
                                "closed without a stop message")
            raise LeaderLost("the leader left the group")
        return frame

    def serve(self, dispatch: Callable[[dict[str, np.ndarray], Any], Any],
              call: Callable[[str, dict[str, Any], dict[str, np.ndarray]], None]) -> int:
        """Replays steps until `stop` and returns how many ran; at end of file the leader is lost.

        `dispatch(arrays, previous_result)` launches one step and returns its result;
        `call(method, fields, arrays)` replays device work the leader did between steps."""
        results: dict[int, Any] = {}
        replayed = 0
        log.info("follower %d replaying the leader's steps", self.group.process_id)
        while True:
            header, arrays = self._receive()
            if header["op"] == "stop":
                self.sock.close()
                return replayed
            if header["op"] == "call":
                self._replaying(f"call {header['method']}", call, header["method"], header["fields"], arrays)
                continue
            number, previous = header["number"], header["previous"]
            if previous >= 0 and previous not in results:
                raise LeaderLost(f"step {number} reads step {previous}, which this follower no longer keeps")
            results[number] = self._replaying(f"step {number}", dispatch, unpack_step(header, arrays),
                                              results.get(previous))
            results.pop(number - KEPT_RESULTS, None)
            replayed += 1

    def _replaying(self, what: str, replay: Callable[..., Any], *args: Any) -> Any:
        """`replay(*args)`; if it fails, the process ends at once, closing its control connection so the
        leader stops the group now (not in a collective's timeout, then JAX's exit-time barrier)."""
        try:
            return replay(*args)
        except Exception as error:
            log.critical("follower %d could not replay %s", self.group.process_id, what, exc_info=error)
            self.sock.close()
            _exit_now(f"follower {self.group.process_id}: replaying the leader's {what} failed ({error!r}); "
                      "the group stops", REPLAY_FAILED_EXIT)


def connect(group: ProcessGroup) -> Leader | Follower | None:
    """Joins the group's control channel: process 0 leads; None for a single process."""
    if not group.distributed:
        return None
    return Leader(group) if group.process_id == 0 else Follower(group)
