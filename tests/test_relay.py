"""bench.harness.relay on loopback, in-process (no root): bytes arrive exactly and in order both ways
under delay and jitter, the RTT is twice the one-way delay, half-close and reset cross it,
backpressure bounds what it holds, gRPC runs through it, and its delay changes mid-connection
(in-process and through the control channel of `python -m bench.harness.relay`)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import struct
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.harness.relay import CHUNK, Delay, Relay, RelayProcess, release_at, sent_at


@pytest.fixture
async def serve():
    """serve(handler) -> "HOST:PORT" of an asyncio server on loopback; closed after the test."""
    servers = []

    async def start(handler) -> str:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def relay_to():
    """relay_to(target, delay) -> (relay, "HOST:PORT") listening on loopback; closed after the test."""
    relays = []

    async def start(target: str, delay: Delay | None = None, **kw) -> tuple[Relay, str]:
        relay = Relay(target, delay or Delay(), seed=1, **kw)
        relays.append(relay)
        return relay, await relay.start("127.0.0.1", 0)

    yield start
    for relay in relays:
        await relay.close()


async def connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionResetError:
        pass  # the relay resets what is left open when a test closes it
    writer.close()


async def ping_ms(reader, writer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.monotonic()
        writer.write(b"p" * 32)
        await reader.readexactly(32)
        times.append((time.monotonic() - started) * 1e3)
    return times


def test_release_times_keep_order_and_jitter_spreads_them():
    rng, delay = random.Random(0), Delay(10.0, 8.0)
    arrived, previous, offsets = 0.0, 0.0, []
    for _ in range(2000):
        arrived += rng.uniform(0, 0.02)  # gaps of 0-20 ms: some chunks would overtake without the clamp
        at = release_at(arrived, previous, delay, rng)
        assert at >= previous and at >= arrived + 0.002 - 1e-9  # never before the chunk ahead; delay - jitter
        offsets.append((at - arrived) * 1e3)
        previous = at
    assert max(offsets) > 17 and min(offsets) < 3  # jitter spans +/- 8 ms around 10
    assert release_at(1.0, 0.0, Delay(0.0, 5.0), random.Random(0)) >= 1.0  # negative offsets clamp to 0
    with pytest.raises(ValueError):
        Delay(-1.0)


async def test_bytes_arrive_exactly_both_ways_through_half_close(serve, relay_to):
    up, down = os.urandom(6 << 20), os.urandom(5 << 20)
    received = asyncio.get_running_loop().create_future()

    async def server(reader, writer):  # read all the client sends (until its half-close), then answer
        received.set_result(await reader.read())
        writer.write(down)
        await writer.drain()
        writer.close()

    relay, address = await relay_to(await serve(server), Delay(5.0, 3.0))
    reader, writer = await connect(address)

    async def send():
        for i in range(0, len(up), 100_000):  # many writes: many chunks, each with its own jitter
            writer.write(up[i:i + 100_000])
            await writer.drain()
        writer.write_eof()

    _, got = await asyncio.wait_for(asyncio.gather(send(), reader.read()), 30)
    assert await received == up and got == down
    writer.close()


def test_a_rate_spaces_chunks_by_their_size():
    assert sent_at(1.0, 0.0, 125_000, 0.0) == 1.0  # no rate: sent as it arrives
    assert sent_at(1.0, 0.0, 125_000, 10.0) == pytest.approx(1.1)  # 1 Mbit at 10 Mbit/s: 100 ms
    assert sent_at(1.0, 1.5, 125_000, 10.0) == pytest.approx(1.6)  # behind the chunk ahead of it
    with pytest.raises(ValueError):
        Delay(rate_mbit=-1.0)


async def test_a_rate_limits_the_link_shared_by_every_connection(serve, relay_to):
    """2 MB each way-down over two connections at once through 40 Mbit/s: ~0.8 s together, the
    bytes exact."""
    blob = os.urandom(2 << 20)

    async def server(reader, writer):
        writer.write(blob)
        await writer.drain()
        writer.close()

    relay, address = await relay_to(await serve(server), Delay(rate_mbit=40.0))
    started = time.monotonic()

    async def fetch() -> bytes:
        reader, writer = await connect(address)
        got = await reader.read()
        writer.close()
        return got

    got = await asyncio.wait_for(asyncio.gather(fetch(), fetch()), 30)
    took = time.monotonic() - started
    assert got == [blob, blob]
    ideal = 2 * len(blob) * 8 / 40e6  # 0.84 s
    assert 0.9 * ideal <= took <= 2.0 * ideal, (took, ideal)


async def test_rtt_is_twice_the_one_way_delay(serve, relay_to):
    relay, address = await relay_to(await serve(echo), Delay(20.0))
    reader, writer = await connect(address)
    rtt = statistics.median((await ping_ms(reader, writer, 11))[1:])
    assert 35 <= rtt <= 80, rtt
    assert relay.set(Delay(5.0))["applied"] == {"delay_ms": 5.0, "jitter_ms": 0.0, "rate_mbit": 0.0}  # same connection, new delay
    await ping_ms(reader, writer, 1)
    rtt = statistics.median(await ping_ms(reader, writer, 10))
    assert 8 <= rtt <= 30, rtt
    writer.close()


async def test_jitter_never_reorders_bytes(serve, relay_to):
    relay, address = await relay_to(await serve(echo), Delay(5.0, 5.0))
    reader, writer = await connect(address)
    chunks = [struct.pack("!I", i) * 64 for i in range(300)]
    for chunk in chunks:  # separate reads at the relay: each chunk draws its own delay in [0, 10] ms
        writer.write(chunk)
        await writer.drain()
        await asyncio.sleep(0.001)
    got = await asyncio.wait_for(reader.readexactly(sum(map(len, chunks))), 30)
    assert got == b"".join(chunks)
    writer.close()


async def test_reset_crosses_the_relay_both_ways(serve, relay_to):
    async def resetting_server(reader, writer):
        await reader.readexactly(1)
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    _, address = await relay_to(await serve(resetting_server), Delay(2.0))
    reader, writer = await connect(address)
    writer.write(b"x")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(), 10)

    seen = asyncio.get_running_loop().create_future()

    async def reading_server(reader, writer):
        try:
            seen.set_result(await reader.read())
        except ConnectionResetError as exc:
            seen.set_result(exc)

    _, address = await relay_to(await serve(reading_server), Delay(2.0))
    reader, writer = await connect(address)
    writer.write(b"abc")
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    assert isinstance(await asyncio.wait_for(seen, 10), ConnectionResetError)


async def test_refused_target_resets_the_client(relay_to):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections are refused
        _, address = await relay_to(dead)
        reader, writer = await connect(address)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), 10)


async def test_backpressure_bounds_what_the_relay_holds(serve, relay_to):
    stalled = asyncio.Event()

    async def not_reading(reader, writer):
        await stalled.wait()
        writer.close()

    limit = 1 << 20
    relay, address = await relay_to(await serve(not_reading), Delay(1.0), max_queue_bytes=limit)
    reader, writer = await connect(address)
    block, sent = b"\0" * (1 << 20), 0

    async def flood():
        nonlocal sent
        while sent < 256 << 20:
            writer.write(block)
            await writer.drain()
            sent += len(block)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(flood(), 2.0)  # the client blocks: nothing buffers 256 MiB for it
    assert sent < 64 << 20
    assert relay.peak_queued <= limit + CHUNK
    stalled.set()
    writer.close()


async def test_grpc_over_many_connections():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    relay = Relay(f"127.0.0.1:{port}", Delay(3.0, 2.0))
    address = await relay.start()

    async def check() -> int:
        # a subchannel pool per channel: one TCP connection each (else gRPC shares one)
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            replies = [await stub.Check(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(3)]
            return sum(r.status == health_pb2.HealthCheckResponse.SERVING for r in replies)

    try:
        assert await asyncio.gather(*(check() for _ in range(20))) == [3] * 20
        assert relay.connections >= 20
    finally:
        await relay.close()
        await server.stop(None)


async def test_relay_process_control_channel(serve):
    target = await serve(echo)
    relay = await asyncio.to_thread(RelayProcess, "127.0.0.1:0", target, Delay(15.0))
    try:
        reader, writer = await connect(relay.address)
        await ping_ms(reader, writer, 1)
        assert 25 <= statistics.median(await ping_ms(reader, writer, 5)) <= 70
        before = time.monotonic()
        reply = await asyncio.to_thread(relay.set, Delay(2.0, 1.0))
        assert reply["applied"] == {"delay_ms": 2.0, "jitter_ms": 1.0, "rate_mbit": 0.0} and before <= reply["at"] <= time.monotonic()
        await ping_ms(reader, writer, 1)
        assert statistics.median(await ping_ms(reader, writer, 5)) <= 20
        writer.close()
    finally:
        assert await asyncio.to_thread(relay.close) == 0
