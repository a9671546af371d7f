"""The HTTP server of the metrics port (`--metrics-port`): Prometheus' text exposition of one
registry, with every peer's cost bounded.

Owns: the server only (what it serves is shared.metrics'). prometheus_client's own
`start_http_server` starts a thread per connection with no timeout, so a peer that opens
connections and never finishes a request held one thread each, for as long as it liked. Here a
connection lives at most TIMEOUT_S from its accept, however it trickles its bytes (a socket
timeout alone restarts at every byte: 20 peers sending one byte every 4 s held every slot for as
long as they liked), at most MAX_CONNECTIONS are served at once and at most MAX_PER_PEER from one
address, so one peer cannot take every slot from the scrapers; one more is closed at once, unread
(a scraper retries at its next interval).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections import Counter
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

MAX_CONNECTIONS = 16
MAX_PER_PEER = 4
TIMEOUT_S = 10.0


class _Handler(WSGIRequestHandler):
    timeout = TIMEOUT_S  # the connection's socket timeout (StreamRequestHandler.setup)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # never joined at close (ThreadingMixIn keeps non-daemon threads to join)
    request_queue_size = 64  # the listen backlog (socketserver's 5 made connects wait for SYN retries)
    refused = 0  # connections closed unread: MAX_CONNECTIONS were being served

    def __init__(self, *args: Any, **kw: Any):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.peers: Counter[str] = Counter()  # connections being served, per peer address
        self.peers_lock = threading.Lock()
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        with self.peers_lock:
            if self.peers[peer] >= MAX_PER_PEER or not self.slots.acquire(blocking=False):
                self.refused += 1
                self.shutdown_request(request)
                return
            self.peers[peer] += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(peer)  # no thread took it
            raise

    def _release(self, peer: str) -> None:
        with self.peers_lock:
            self.peers[peer] -= 1
            if not self.peers[peer]:
                del self.peers[peer]
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that timed out or left is not an error of ours (socketserver prints a traceback)."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = threading.Timer(self.RequestHandlerClass.timeout, _cut, (request,))  # type: ignore[attr-defined]
        cut.daemon = True
        try:
            try:
                cut.start()
            except RuntimeError:  # no thread to spare: served with the per-read timeout only
                pass
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()  # a no-op on a timer that never started
            self._release(str(client_address[0]))


def _cut(request: socket.socket) -> None:
    """End a connection past its time: its handler's next read or write fails and it returns."""
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


def serve(registry: CollectorRegistry, port: int, host: str) -> BoundedServer:
    """The metrics endpoint on host:port (port 0: any free), served from a daemon thread."""
    server_class = type("Server", (BoundedServer,), {"address_family": _family(host, port)})
    server = cast(
        BoundedServer, make_server(host, port, make_wsgi_app(registry), server_class=server_class, handler_class=_Handler)
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def _family(host: str, port: int) -> socket.AddressFamily:
    """IPv6 where the host is an IPv6 address (as prometheus_client's server chooses)."""
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
