"""Fault injection in front of a real storage endpoint, for tests and soaks.

:class:`StorageProxy` is a TCP proxy on 127.0.0.1 in front of an S3 endpoint (moto's server
in the tests) whose faults are set while it runs, chainable in the style of torchft's fault
injection::

    proxy = StorageProxy(moto_port).start()
    store = open_store("s3://ckpt/run", endpoint_url=proxy.url, ...)
    proxy.slow(timedelta(seconds=2))   # every request takes 2 s longer
    proxy.hang()                       # requests wait (connections stay open) until ...
    proxy.heal()                       # ... normal service again
    proxy.refuse()                     # new connections refused, open ones reset

Bytes are forwarded unchanged; only their timing (or the connection) is affected, so the
client sees exactly what a slow, hung or unreachable endpoint looks like.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from datetime import timedelta

__all__ = ["StorageProxy"]

_CHUNK = 1 << 16


class StorageProxy:
    """A TCP proxy to ``127.0.0.1:upstream_port`` with injectable faults.

    Args:
        upstream_port: the port of the real endpoint.
        port: where to listen (0: any free port; see :attr:`url`).
    """

    def __init__(self, upstream_port: int, *, port: int = 0) -> None:
        self.upstream = ("127.0.0.1", int(upstream_port))
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._delay = 0.0
        self._open = threading.Event()      # cleared: requests hang until heal()
        self._open.set()
        self._match: bytes | None = None
        self._refusing = False
        self._closed = False
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.requests = 0                   # requests received (a hung one included)
        self._thread = threading.Thread(target=self._accept, name="storage-proxy", daemon=True)

    # -- faults ----------------------------------------------------------------------------
    def slow(self, delay: timedelta) -> "StorageProxy":
        """Every request waits ``delay`` before it is forwarded (a request: what a client
        sends after the endpoint's previous response on that connection)."""
        if delay < timedelta(0):
            raise ValueError(f"delay must be >= 0, got {delay}")
        self._delay = delay.total_seconds()
        return self

    def hang(self, match: str | None = None) -> "StorageProxy":
        """Requests wait, connections open, until :meth:`heal` (a stuck endpoint); with
        ``match``, only requests whose first line holds it (``"/manifests/"``: commits only)."""
        self._match = match.encode() if match is not None else None
        self._open.clear()
        return self

    def refuse(self) -> "StorageProxy":
        """New connections are refused (reset at once) and open ones are reset (an endpoint that is down)."""
        self._refusing = True
        self._drop_all()
        return self

    def heal(self) -> "StorageProxy":
        """Normal service: no delay, no hang, connections accepted."""
        self._delay = 0.0
        self._refusing = False
        self._open.set()
        self._match = None
        return self

    # -- running ---------------------------------------------------------------------------
    def start(self) -> "StorageProxy":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        self._open.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._drop_all()

    def __enter__(self) -> "StorageProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_all(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._refusing:
                try:
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    client.close()
                except OSError:
                    pass
                continue
            threading.Thread(target=self._serve, args=(client,), name="storage-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._conns.update((client, upstream))
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        new_request = True   # the next bytes from the client start a request (HTTP keep-alive)
        held = True          # this request is subject to hang()
        try:
            while not self._closed:
                for key, _ in sel.select(timeout=0.5):
                    src, dst = key.fileobj, key.data
                    data = src.recv(_CHUNK)  # type: ignore[union-attr]
                    if not data:
                        return
                    if src is client:
                        if new_request:
                            self.requests += 1
                            line = data.split(b"\r\n", 1)[0]
                            held = self._match is None or self._match in line
                        if held:
                            self._open.wait()
                        if new_request:
                            new_request = False
                            if self._delay:
                                time.sleep(self._delay)
                    else:
                        new_request = True
                    dst.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            with self._lock:
                self._conns.discard(client)
                self._conns.discard(upstream)
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass
