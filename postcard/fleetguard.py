"""The public Fleet listener's connection guard (issue #62, finding 6): a cap on open connections and
deadlines for request headers and bodies, which uvicorn does not have (its keep-alive timeout starts
after a first response; nothing times out a half-sent request). :mod:`postcard.fleetgate` runs it on
the public listener only; the loopback (operator) listener is never capped."""

from __future__ import annotations

import asyncio
import logging
import socket

MAX_CONNECTIONS = 512  # open connections on the public listener (TLS handshakes included)
HEADER_TIMEOUT = 10.0  # s: from accept (or the end of the previous response) to complete request headers
BODY_TIMEOUT = 30.0  # s: the longest silence inside a request body
MAX_HEADER_BYTES = 64 * 1024  # a request's headers on the public listener
SLOW_BODY_RATE = 32 * 1024  # B/s: at the cap, a request body slower than this on average may give way
FD_RESERVE = 256  # file descriptors kept for everything but the public listener's connections
_REFUSE_BURST = 1024  # connections closed at the cap in one accept() call before the event loop gets a turn


class _FleetSocket(socket.socket):
    """An accepted connection of the public listener: its :class:`FleetGuard` forgets it when it is closed."""

    guard: FleetGuard | None = None
    loop: asyncio.AbstractEventLoop | None = None
    protocol = None  # the HTTP protocol, once the TLS handshake is done
    timer: asyncio.TimerHandle | None = None
    phase = "headers"  # headers: waiting for a request's headers; body: reading its body; app: being answered
    header_bytes = 0
    body_bytes = 0
    body_start = 0.0
    last_data = 0.0

    def close(self) -> None:
        if self.guard is not None:
            self.guard.forget(self)
        super().close()


class _FleetListener(socket.socket):
    """The public listening socket: each ``accept()`` (asyncio's selector loop calls it) goes through its guard."""

    guard: FleetGuard

    def accept(self):
        for _ in range(_REFUSE_BURST):
            fd, addr = self._accept()  # BlockingIOError when none is waiting: asyncio's signal to stop
            conn = _FleetSocket(self.family, self.type, self.proto, fileno=fd)
            if self.guard.admit(conn):
                return conn, addr
            conn.close()
        raise ConnectionAbortedError("a burst of connections closed at the cap")  # asyncio: next turn


class FleetGuard:
    """The public listener's connections: at most ``max_connections`` open, counted from ``accept()``
    (before the TLS handshake); each closed unless its request headers are complete within
    ``header_timeout`` of its accept or of its previous response, or when its request body stays
    silent for ``body_timeout``. At the cap a new connection takes the place of the oldest one waiting
    for request headers, else of the slowest request body (on average since its headers, once it has lasted
    a second, if under :data:`SLOW_BODY_RATE`), else it is closed at once. The loopback listener's
    connections are not counted."""

    def __init__(self, max_connections: int = MAX_CONNECTIONS, header_timeout: float = HEADER_TIMEOUT,
                 body_timeout: float = BODY_TIMEOUT, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        if max_connections < 1 or header_timeout <= 0 or body_timeout <= 0:
            raise ValueError("the Fleet listener needs max_connections >= 1 and positive timeouts")
        self.max_connections = int(max_connections)
        self.header_timeout = float(header_timeout)
        self.body_timeout = float(body_timeout)
        self.max_header_bytes = int(max_header_bytes)
        self.port: int | None = None  # the public listener's port (:meth:`listen`)
        self.open: dict[int, _FleetSocket] = {}  # file descriptor -> connection
        self.waiting: dict[int, _FleetSocket] = {}  # those waiting for request headers, the longest-waiting first
        self.closed: dict[str, int] = {}  # why -> how many connections the guard closed so
        self._reported: dict[str, int] = {}
        self._report_at = float("-inf")
        self.log = logging.getLogger("uvicorn.error")

    def listen(self, host: str, port: int, backlog: int = 2048) -> socket.socket:
        """The public listening socket, bound (``port`` 0: any free port, then :attr:`port` says which)."""
        sock = _FleetListener(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.guard = self
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        return sock

    # ------------------------------------------------------------------ the connection's life
    def admit(self, conn: _FleetSocket) -> bool:
        """A connection just accepted: counted and given its header deadline, or False (to be closed)."""
        if len(self.open) >= self.max_connections:
            victim, why = self._victim()
            if victim is None:  # every connection is in a request that goes well: nothing gives way
                self._note("refused at the cap")
                return False
            self.drop(victim, why)
        conn.guard, conn.loop = self, asyncio.get_running_loop()
        self.open[conn.fileno()] = conn
        self.await_headers(conn)
        return True

    def _victim(self) -> tuple[_FleetSocket | None, str]:
        """The connection that gives way to a new one at the cap: the one waiting longest for request
        headers, else the slowest request body (:data:`SLOW_BODY_RATE`), else none."""
        oldest = next(iter(self.waiting.values()), None)
        if oldest is not None:
            return oldest, "evicted at the cap (waiting for request headers)"
        now, slowest, lowest = asyncio.get_running_loop().time(), None, float(SLOW_BODY_RATE)
        for conn in self.open.values():
            if conn.phase == "body" and now - conn.body_start >= 1.0:
                rate = conn.body_bytes / (now - conn.body_start)
                if rate < lowest:
                    slowest, lowest = conn, rate
        return slowest, "evicted at the cap (a slow request body)"

    def attach(self, protocol, transport) -> _FleetSocket | None:
        """The connection under ``transport`` (its TLS handshake done), or None if it is not counted."""
        sock = transport.get_extra_info("socket")
        conn = self.open.get(sock.fileno()) if sock is not None else None
        if conn is not None:
            conn.protocol = protocol
        return conn

    def await_headers(self, conn: _FleetSocket) -> None:
        conn.phase, conn.header_bytes = "headers", 0
        self.waiting.pop(conn.fileno(), None)
        self.waiting[conn.fileno()] = conn
        self._arm(conn, self.header_timeout, self._header_deadline)

    def headers_complete(self, conn: _FleetSocket) -> None:
        self.waiting.pop(conn.fileno(), None)
        conn.phase, conn.body_bytes = "body", 0
        conn.body_start = conn.last_data = conn.loop.time()
        self._arm(conn, self.body_timeout, self._body_deadline)

    def body_complete(self, conn: _FleetSocket) -> None:
        conn.phase = "app"
        self._arm(conn, None, None)

    def forget(self, conn: _FleetSocket) -> None:
        """``conn`` is being closed: no longer counted."""
        fd = conn.fileno()
        if self.open.get(fd) is conn:
            del self.open[fd]
        if self.waiting.get(fd) is conn:
            del self.waiting[fd]
        self._arm(conn, None, None)
        conn.guard = None

    def drop(self, conn: _FleetSocket, why: str) -> None:
        """Close ``conn`` now (no longer counted from here on)."""
        self.forget(conn)
        self._note(why)
        transport = getattr(conn.protocol, "transport", None)
        if transport is not None:
            transport.abort()
        else:  # still in its TLS handshake: the transport reads the end of the stream and closes itself
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------ deadlines
    @staticmethod
    def _arm(conn: _FleetSocket, delay: float | None, callback) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        if delay is not None:
            conn.timer = conn.loop.call_later(delay, callback, conn)

    def _header_deadline(self, conn: _FleetSocket) -> None:
        conn.timer = None
        if conn.guard is self and conn.phase == "headers":
            self.drop(conn, f"no complete request headers within {self.header_timeout:g} s")

    def _body_deadline(self, conn: _FleetSocket) -> None:
        conn.timer = None
        if conn.guard is not self or conn.phase != "body":
            return
        silent = conn.loop.time() - conn.last_data
        if silent < self.body_timeout:
            self._arm(conn, self.body_timeout - silent, self._body_deadline)
        elif getattr(getattr(conn.protocol, "flow", None), "read_paused", False):  # the app has not read yet
            self._arm(conn, self.body_timeout, self._body_deadline)
        else:
            self.drop(conn, f"a request body silent for {self.body_timeout:g} s")

    def _note(self, why: str) -> None:
        """Count a closed connection; a warning at most once a minute with the counts since the last one."""
        self.closed[why] = self.closed.get(why, 0) + 1
        self._reported[why] = self._reported.get(why, 0) + 1
        now = asyncio.get_running_loop().time()
        if now - self._report_at >= 60.0:
            self._report_at = now
            counts = ", ".join(f"{n} {reason}" for reason, n in self._reported.items())
            self._reported = {}
            self.log.warning("Fleet listener: closed %s; %d connections open (cap %d)", counts, len(self.open),
                             self.max_connections)


def guarded_protocol(guard: FleetGuard, base: type | None = None) -> type:
    """uvicorn's httptools HTTP protocol, with ``guard``'s deadlines on the connections of its listener."""
    if base is None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base

    class FleetGuardedProtocol(base):
        _fleet: _FleetSocket | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if self.server is None or self.server[1] != guard.port:
                return  # the loopback listener
            self._fleet = guard.attach(self, transport)
            if self._fleet is None:  # not counted (closed at the cap during its handshake): fail closed
                transport.abort()

        def data_received(self, data: bytes) -> None:
            conn = self._fleet
            if conn is None:
                return super().data_received(data)
            if conn.phase == "body":
                conn.last_data = conn.loop.time()
                conn.body_bytes += len(data)
            elif conn.phase == "headers":
                conn.header_bytes += len(data)
            super().data_received(data)
            if conn.phase == "headers" and conn.header_bytes > guard.max_header_bytes and conn.guard is guard:
                guard.drop(conn, f"request headers over {guard.max_header_bytes} bytes")

        def on_headers_complete(self) -> None:
            if self._fleet is not None and self._fleet.guard is guard:
                guard.headers_complete(self._fleet)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self._fleet is not None and self._fleet.guard is guard:
                guard.body_complete(self._fleet)

        def on_response_complete(self) -> None:
            queued = bool(self.pipeline)  # a pipelined request starts now: it is past its headers
            super().on_response_complete()
            conn = self._fleet
            if conn is not None and conn.guard is guard and not queued and not self.transport.is_closing():
                guard.await_headers(conn)

    return FleetGuardedProtocol


def fit_fd_limit(max_connections: int, reserve: int = FD_RESERVE) -> int:
    """``max_connections``, after raising the soft file-descriptor limit (within the hard one) to it plus
    ``reserve``; lowered to fit if the limit cannot be raised so far."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft - reserve < max_connections:
        fitted = max(1, soft - reserve)
        print(f"[fleetgate] --fleet-max-connections {max_connections} lowered to {fitted}: the file-descriptor "
              f"limit is {soft} (hard {hard}) and {reserve} are kept for the rest of the SuperLink", flush=True)
        return fitted
    return max_connections
