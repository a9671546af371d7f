"""The KV events replay port (vLLM's protocol): a ROUTER socket, served a little at a time by the
publisher's thread (shared.kv_events) between the batches it publishes.

Owns: reading requests, one cursor per asking peer, and sending each peer its answer as fast as
that peer takes it. A request `[identity, b"", start_seq (8 bytes big-endian)]` is answered with one
`[identity, b"", seq, payload]` per buffered batch whose seq is in [start_seq, the newest when it
asked], then `[identity, b"", -1 (8 bytes, signed), b""]`. Sends never block and never drop
(ZMQ_ROUTER_MANDATORY): where a peer's pipe is full the cursor waits for the next turn, so a
reader that starts late or reads slowly still gets every batch and the end (before: a ROUTER drops
what passes its high-water mark, silently: 3000 of a 5000-batch replay arrived, and no end). A
batch the buffer evicted while a slow reader lagged is skipped: its seq is missing from the answer.

Bounded for any peer: a request is at most 64 bytes (ZMQ_MAXMSGSIZE; a larger one disconnects its
sender before it is held); at most `max_replays` answers are under way (more requests wait in the
socket); each turn reads at most REQUESTS_PER_TURN requests and sends at most SENDS_PER_TURN
messages per answer, so a flood of requests never holds up publishing; an answer that makes no
progress for `idle_s` seconds (its reader stopped) is dropped; malformed requests are ignored and
counted, and logged at the 1st, 2nd, 4th, 8th ... only.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_REQUEST_BYTES = 64
REQUESTS_PER_TURN = 16
SENDS_PER_TURN = 256


@dataclass
class _Answer:
    next_seq: int  # the next batch to send
    last_seq: int  # the newest batch when the peer asked; the end follows it
    progressed: float  # monotonic time of the last send


class ReplayServer:
    def __init__(self, ctx: zmq.Context, endpoint: str, max_replays: int = 64, idle_s: float = 30.0):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.max_replays = max_replays
        self.idle_s = idle_s
        self.answers: OrderedDict[bytes, _Answer] = OrderedDict()  # peer identity -> its answer
        self.replays = 0  # answers sent to their end
        self.ignored = 0  # malformed requests
        self.abandoned = 0  # answers dropped: the peer left or stopped reading for idle_s

    @property
    def busy(self) -> bool:
        """Answers are under way (the publisher's thread should come back soon)."""
        return bool(self.answers)

    def turn(self, buffer: deque[tuple[int, bytes]]) -> None:
        """Read a few requests, then send each answer what its peer takes now."""
        taken = 0
        while len(self.answers) < self.max_replays and taken < REQUESTS_PER_TURN and self.sock.poll(0):
            self._take(self.sock.recv_multipart(), buffer)
            taken += 1
        now = time.monotonic()
        for peer, answer in list(self.answers.items()):
            if self._send(peer, answer, buffer):
                answer.progressed = now
            elif peer in self.answers and now - answer.progressed > self.idle_s:
                del self.answers[peer]
                self.abandoned += 1

    def _take(self, frames: list[bytes], buffer: deque[tuple[int, bytes]]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.ignored += 1
            if self.ignored & (self.ignored - 1) == 0:
                log.warning("kv events replay: malformed request (%d frames) ignored; %d so far", len(frames), self.ignored)
            return
        newest = buffer[-1][0] if buffer else -1
        # a new ask replaces one under way
        self.answers[frames[0]] = _Answer(int.from_bytes(frames[2], "big"), newest, time.monotonic())

    def _send(self, peer: bytes, answer: _Answer, buffer: deque[tuple[int, bytes]]) -> bool:
        """Send what the peer's pipe takes now (at most SENDS_PER_TURN batches, then the end once
        every batch up to last_seq the buffer still holds went); True if anything went."""
        first = bisect.bisect_left(buffer, answer.next_seq, key=lambda batch: batch[0])  # seqs ascend
        sent = 0
        for seq, payload in itertools.islice(buffer, first, None):
            if seq > answer.last_seq:
                break
            if sent == SENDS_PER_TURN or not self._try(peer, (peer, b"", seq.to_bytes(8, "big"), payload)):
                return sent > 0
            answer.next_seq = seq + 1
            sent += 1
        if not self._try(peer, (peer, b"", END_SEQ, b"")):
            return sent > 0
        del self.answers[peer]
        self.replays += 1
        return True

    def _try(self, peer: bytes, frames: tuple) -> bool:
        """One message without blocking: False where the peer's pipe is full (try again next turn);
        a peer that left ends its answer."""
        try:
            self.sock.send_multipart(frames, flags=zmq.DONTWAIT)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.answers.pop(peer, None)
            self.abandoned += 1
            return False

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(linger=0)
