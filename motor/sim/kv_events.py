"""KV cache events on ZMQ in vLLM's wire format (``../shared/reference/protocols.md`` §1).

PUB socket, one message per engine step that had events::

    [topic, seq (uint64 big-endian, 8 bytes, from 0), msgpack payload]
    payload = [ts: float, events: list, data_parallel_rank: int]

Events are tagged maps (vLLM >= 0.26)::

    {"type": "BlockStored", "block_hashes": [uint64...], "parent_block_hash": uint64 | None,
     "token_ids": [int...], "block_size": int, "lora_id": None, "medium": "GPU",
     "lora_name": str | None}      (the LoRA adapter the blocks were computed under)
    {"type": "BlockRemoved", "block_hashes": [uint64...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Replay: a ROUTER socket; a DEALER sends ``[b"", start_seq (8 bytes big-endian)]`` and
gets every buffered message with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``,
then the end marker ``[b"", b"", 0xFF * 8, b""]``.

Unlike vLLM (which binds only ``*`` / ``::`` / ipc / inproc endpoints and connects
otherwise), the simulator always **binds** both sockets. ``tcp://host:0`` or
``tcp://host:*`` binds an ephemeral port (see :attr:`KvEventPublisher.endpoint`). A DP
rank r > 0 offsets an explicit TCP port by r, as vLLM does.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
MEDIUM_GPU = "GPU"


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """``tcp://h:P`` -> ``tcp://h:P+dp_rank`` (other endpoints unchanged); ``:0`` -> ``:*``."""
    m = re.match(r"^(tcp://.+):(\d+)$", endpoint)
    if not m:
        return endpoint
    port = int(m.group(2))
    if port == 0:
        return m.group(1) + ":*"
    return f"{m.group(1)}:{port + dp_rank}"


def encode_events(events: list[tuple], block_size: int) -> list[dict[str, object]]:
    """The pool's event records (:mod:`motor.sim.kv`) as vLLM's tagged maps."""
    out: list[dict[str, object]] = []
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            out.append({"type": "BlockStored", "block_hashes": ev[1], "parent_block_hash": ev[2],
                        "token_ids": ev[3], "block_size": block_size, "lora_id": None,
                        "medium": MEDIUM_GPU, "lora_name": ev[4] if len(ev) > 4 else None})
        elif kind == "removed":
            out.append({"type": "BlockRemoved", "block_hashes": ev[1], "medium": MEDIUM_GPU})
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"})
    return out


class KvEventPublisher:
    """PUB + replay ROUTER sockets of one simulator, on the event loop thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int,
                 dp_rank: int = 0, buffer_steps: int = 10000, hwm: int = 100000) -> None:
        self.topic = topic.encode()
        self.block_size = block_size
        self.dp_rank = dp_rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        # PUB never blocks, so it lives on a plain context; the replay ROUTER is awaited
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.bind(offset_endpoint(endpoint, dp_rank))
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._router = self._actx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(offset_endpoint(replay_endpoint, dp_rank))
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                name="motor-sim-kv-replay")
        self.num_published = 0
        self.num_dropped = 0

    def publish(self, events: list[tuple]) -> None:
        """Send one step's events as one batch (never blocks; drops beyond the HWM)."""
        payload = msgpack.packb([time.time(), encode_events(events, self.block_size),
                                 self.dp_rank], use_bin_type=True)
        seq = self.seq
        self.seq += 1
        seq8 = seq.to_bytes(8, "big")
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq8, payload], flags=zmq.NOBLOCK)
            self.num_published += 1
        except zmq.Again:
            self.num_dropped += 1

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                logger.debug("kv replay: ignoring a %d-frame request", len(frames))
                continue
            ident, _empty, start8 = frames
            start = int.from_bytes(start8, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"),
                                                 payload])
            await router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def source(self) -> dict[str, object]:
        """This publisher's config with resolved endpoints (vLLM's ``/kv_event_sources`` entry)."""
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "buffer_steps": self.buffer_steps,
                "hwm": self.hwm, "topic": self.topic.decode()}

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self.close()

    def close(self) -> None:
        for s in (self._pub, self._router):
            if s is not None and not s.closed:
                s.close(linger=0)
        for c in (self._ctx, self._actx):
            if not c.closed:
                c.term()
