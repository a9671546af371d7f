"""A hostile gRPC peer over raw HTTP/2 (h2): calls that send all but the last bytes of their request
message and then wait. grpc-core holds such a message until it is whole, before any handler (and
so any admission) sees it; what bounds that memory is the server's cap on calls in progress and its
receive limit (shared.grpc_server). Used by bench.serving.slow_bodies and tests/test_grpc_intake.py.
"""

from __future__ import annotations

import asyncio

import h2.config
import h2.connection
import h2.events

UNSENT = 10  # the bytes of each message that never come


def _status(headers) -> int | None:
    for key, value in headers:
        if key in (b"grpc-status", "grpc-status"):
            return int(value)
    return None


async def stalled_calls(port: int, path: str, calls: int, size: int, hold_s: float, host: str = "127.0.0.1") -> list[int | None]:
    """`calls` calls to `path` on one HTTP/2 connection, each declaring a `size`-byte message and
    sending all but its last UNSENT bytes as flow control lets it; held `hold_s` seconds. Per call:
    the grpc-status the server ended it with while it was held (-1: reset without one), None if the
    call was still open."""
    reader, writer = await asyncio.open_connection(host, port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    left: dict[int, int] = {}
    for _ in range(calls):
        sid = conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"{host}:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        conn.send_headers(sid, headers)
        conn.send_data(sid, b"\x00" + size.to_bytes(4, "big"))  # uncompressed, `size` bytes follow
        left[sid] = size - UNSENT
    ended: dict[int, int] = {}
    chunk = bytes(16384)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hold_s
    try:
        while len(ended) < calls:
            for sid in left:
                while left[sid] > 0 and sid not in ended:
                    n = min(left[sid], conn.local_flow_control_window(sid), conn.max_outbound_frame_size, len(chunk))
                    if n <= 0:
                        break
                    conn.send_data(sid, chunk[:n])
                    left[sid] -= n
            writer.write(conn.data_to_send())
            await writer.drain()
            try:
                data = await asyncio.wait_for(reader.read(65536), max(0.0, deadline - loop.time()))
            except TimeoutError:
                break
            if not data:
                ended.update({sid: -1 for sid in left if sid not in ended})
                break
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = _status(event.headers)  # a trailers-only answer is a refusal
                    if status is not None:
                        ended[event.stream_id] = status
                elif isinstance(event, h2.events.StreamReset):
                    ended.setdefault(event.stream_id, -1)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    ended.update({sid: -1 for sid in left if sid not in ended})
    finally:
        writer.close()
    return [ended.get(sid) for sid in left]
