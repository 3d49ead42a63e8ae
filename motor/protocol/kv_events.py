"""KV cache event records of the engines (vLLM, SGLang, ``motor sim``): wire decoding.

Wire format (``../shared/reference/protocols.md`` section 1, vLLM
``vllm/distributed/kv_events.py``, SGLang ``srt/disaggregation/kv_events.py``):

* ZMQ PUB multipart message ``[topic, seq, payload]``; ``seq`` is 8 bytes big-endian,
  from 0 per publisher process, +1 per batch. Replay replies (ROUTER -> DEALER) are
  ``[b"", topic, seq, payload]`` (vLLM >= 0.26) or ``[b"", seq, payload]`` (older),
  ended by a message whose seq is ``0xFF * 8`` (:data:`END_SEQ`).
* ``payload`` is msgpack: ``[ts: float, events: list, dp_rank: int | None]``.
* Each event is a tagged map ``{"type": "BlockStored", ...}`` (vLLM >= 0.24, SGLang
  since #37482) or a tagged array ``["BlockStored", f1, f2, ...]`` with the fields in
  declaration order and trailing defaults trimmed (older versions).

Fields used here (declaration order, vLLM 0.33 / SGLang):

* ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (None for the first block),
  ``token_ids`` (only full blocks), ``block_size``, ``lora_id``, ``medium`` (vLLM
  position 5; SGLang's array form puts it at position 5 too, as an optional field);
  ``lora_name`` after it.
* ``BlockRemoved``: ``block_hashes``, ``medium``.
* ``AllBlocksCleared``: no fields.

Engine block hashes are opaque keys here: unsigned 64-bit ints (vLLM), signed int64
(SGLang) or raw bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). motor never
uses them for matching; it re-hashes the token ids itself.

``medium`` -> tier (:func:`tier_of_medium`): ``GPU`` (also on Ascend and on the CPU
build) -> device; ``CPU``, ``cpu`` (Mooncake / AscendStore), ``CPU_PINNED`` (SGLang)
-> host; ``STORAGE`` (vLLM), ``DISK``, ``EXTERNAL`` (SGLang) -> disk. A missing medium
means device. Any other string stays visibly unknown (``None``); the caller decides.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import msgpack

from motor.errors import WireError

#: Sequence number of the replay end marker (vLLM ``END_SEQ = (-1).to_bytes(8, "big", signed=True)``).
END_SEQ = b"\xff" * 8

#: Storage tiers of a cached block, fastest first: the one Python definition (motor's
#: Python code imports them from here). The compiled prefix index has them as a C enum
#: (``motor/_fast/radix.pxd``, exported as ``motor._fast.radix.TIER_*``) with the same
#: values; ``tests/unit/protocol/test_tiers.py`` checks that they agree.
TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2
#: Tier index -> name.
TIER_NAMES = ("device", "host", "disk")
#: Number of tiers (the second dimension of ``PrefixIndex.match`` output).
N_TIERS = len(TIER_NAMES)

_MEDIUM_TIER = {
    "GPU": TIER_DEVICE, "NPU": TIER_DEVICE,
    "CPU": TIER_HOST, "cpu": TIER_HOST, "CPU_PINNED": TIER_HOST,
    "STORAGE": TIER_DISK, "DISK": TIER_DISK, "EXTERNAL": TIER_DISK,
}


def tier_of_medium(medium: str | None) -> int | None:
    """Engine ``medium`` string -> tier (0 device, 1 host, 2 disk); None when unknown."""
    if medium is None:
        return TIER_DEVICE
    return _MEDIUM_TIER.get(medium)


class BlockStored(NamedTuple):
    """The engine cached ``len(block_hashes)`` full blocks chained after ``parent_block_hash``."""
    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None


class BlockRemoved(NamedTuple):
    """The engine evicted these blocks (from ``medium``)."""
    block_hashes: list[Hashable]
    medium: str | None = None


class AllBlocksCleared(NamedTuple):
    """The engine reset its prefix cache."""


class UnknownEvent(NamedTuple):
    """An event type this version does not know (kept visible, never applied)."""
    type: str


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


class EventBatch(NamedTuple):
    """One publisher message: a scheduler step's events."""
    ts: float
    events: list[KvEvent]
    dp_rank: int | None


def _hash_key(h: Any) -> Hashable:
    if isinstance(h, (int, bytes)):
        return h
    raise WireError(f"block hash is expected to be an int or bytes, got {type(h).__name__}")


def _hashes(v: Any, where: str) -> list[Hashable]:
    if not isinstance(v, (list, tuple)):
        raise WireError(f"{where}.block_hashes is expected to be a list, got {type(v).__name__}")
    return [_hash_key(h) for h in v]


def _decode_event(ev: Any, where: str) -> KvEvent:
    if isinstance(ev, dict):
        kind = ev.get("type")
        get = ev.get
    elif isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        kind = ev[0]
        names = _ARRAY_FIELDS.get(kind, ())
        fields = dict(zip(names, ev[1:]))
        get = fields.get
    else:
        raise WireError(f"{where} is expected to be a tagged map or tagged array, got {ev!r:.80}")
    if kind == "BlockStored":
        hashes = _hashes(get("block_hashes"), where)
        parent = get("parent_block_hash")
        token_ids = get("token_ids")
        block_size = get("block_size")
        if not isinstance(token_ids, (list, tuple)):
            raise WireError(f"{where}.token_ids is expected to be a list, "
                            f"got {type(token_ids).__name__}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise WireError(f"{where}.block_size is expected to be an int > 0, got {block_size!r}")
        if len(token_ids) != len(hashes) * block_size:
            raise WireError(f"{where}: {len(hashes)} block(s) of {block_size} tokens expected "
                            f"{len(hashes) * block_size} token ids, got {len(token_ids)}")
        medium = get("medium")
        lora_name = get("lora_name")
        lora_id = get("lora_id")
        return BlockStored(hashes, None if parent is None else _hash_key(parent),
                           list(token_ids), block_size,
                           medium if isinstance(medium, str) else None,
                           lora_name if isinstance(lora_name, str) and lora_name else None,
                           lora_id if isinstance(lora_id, int) and not isinstance(lora_id, bool)
                           and lora_id > 0 else None)
    if kind == "BlockRemoved":
        medium = get("medium")
        return BlockRemoved(_hashes(get("block_hashes"), where),
                            medium if isinstance(medium, str) else None)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    if isinstance(kind, str):
        return UnknownEvent(kind)
    raise WireError(f"{where}.type is expected to be a string, got {kind!r:.40}")


#: Field order of the tagged-array form (vLLM <= 0.23, SGLang before #37482).
_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> EventBatch:
    """msgpack ``[ts, events, dp_rank]`` -> :class:`EventBatch`.

    Raises
    ------
    WireError
        if the payload is not msgpack or not shaped like an event batch.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise WireError(f"KV event payload is not msgpack: {e}") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2:
        raise WireError(f"KV event batch is expected to be [ts, events, dp_rank], got {obj!r:.80}")
    ts, events = obj[0], obj[1]
    dp_rank = obj[2] if len(obj) > 2 else None
    if not isinstance(ts, (int, float)):
        raise WireError(f"KV event batch ts is expected to be a number, got {ts!r:.40}")
    if not isinstance(events, (list, tuple)):
        raise WireError(f"KV event batch events is expected to be a list, got {events!r:.40}")
    return EventBatch(float(ts), [_decode_event(ev, f"events[{i}]") for i, ev in enumerate(events)],
                      dp_rank if isinstance(dp_rank, int) else None)


def decode_seq(seq8: bytes) -> int:
    """8-byte big-endian sequence number -> int (-1 for :data:`END_SEQ`)."""
    if len(seq8) != 8:
        raise WireError(f"KV event seq is expected to be 8 bytes, got {len(seq8)}")
    return int.from_bytes(seq8, "big", signed=True)


def split_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """A PUB message ``[topic, seq, payload]`` (or ``[seq, payload]``) -> (topic, seq, payload)."""
    if len(frames) == 3:
        return frames[0], decode_seq(frames[1]), frames[2]
    if len(frames) == 2:
        return b"", decode_seq(frames[0]), frames[1]
    raise WireError(f"KV event message is expected to have 3 frames [topic, seq, payload], "
                    f"got {len(frames)}")


def split_replay(frames: Sequence[bytes]) -> tuple[int, bytes]:
    """A replay reply (after the DEALER strips nothing) -> (seq, payload); seq -1 ends it.

    Accepts ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang, ``motor sim``) and
    ``[b"", seq, payload]`` (older vLLM).
    """
    f = list(frames)
    if f and f[0] == b"":
        f = f[1:]
    if len(f) == 3:
        return decode_seq(f[1]), f[2]
    if len(f) == 2:
        return decode_seq(f[0]), f[1]
    raise WireError(f"KV event replay reply is expected as [b'', topic, seq, payload], "
                    f"got {len(frames)} frame(s)")


class KvEventsAddress(NamedTuple):
    """How a subscriber reaches one publisher.

    Text form (the instance table's ``kv_events`` and ``--kv-events``)::

        [bind:]ENDPOINT[;replay=ENDPOINT]

    * ``tcp://HOST:PORT`` / ``ipc://PATH``: the publisher binds there (``motor sim``,
      vLLM with ``*`` / ``::`` / ipc, SGLang with ``*`` / ``0.0.0.0`` / ``bind: true``);
      the subscriber **connects**.
    * ``bind:tcp://HOST:PORT``: the publisher connects (vLLM with an explicit host such
      as ``tcp://127.0.0.1:5557``); the subscriber **binds** that address.
    * ``;replay=ENDPOINT``: the publisher's replay ROUTER (always bound by the engine);
      the subscriber connects a DEALER to fetch missed batches.
    """
    endpoint: str
    bind: bool = False
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> KvEventsAddress:
        """Raises ``WireError`` (a ``ValueError``) for a malformed address."""
        parts = text.strip().split(";")
        ep = parts[0]
        bind = False
        if ep.startswith("bind:"):
            bind, ep = True, ep[len("bind:"):]
        elif ep.startswith("connect:"):
            ep = ep[len("connect:"):]
        if not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise WireError(f"KV events address is expected as [bind:]tcp://HOST:PORT or "
                            f"ipc://PATH[;replay=ENDPOINT], got {text!r}")
        replay = None
        for p in parts[1:]:
            if p.startswith("replay="):
                replay = p[len("replay="):] or None
            elif p:
                raise WireError(f"KV events address option is expected as replay=ENDPOINT, "
                                f"got {p!r} (in {text!r})")
        return cls(ep, bind, replay)

    def for_dp_rank(self, dp_rank: int) -> KvEventsAddress:
        """DP rank r publishes on port + r (vLLM, SGLang); ipc paths are per rank already."""
        if dp_rank == 0:
            return self
        return KvEventsAddress(_offset(self.endpoint, dp_rank), self.bind,
                               _offset(self.replay, dp_rank) if self.replay else None)

    def __str__(self) -> str:
        return ("bind:" if self.bind else "") + self.endpoint + (
            f";replay={self.replay}" if self.replay else "")


def _offset(endpoint: str, r: int) -> str:
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{head}:{int(port) + r}"
    return endpoint


def publisher_binds(engine: str, endpoint: str, bind_flag: bool | None = None) -> bool:
    """Whether an engine's PUB socket binds ``endpoint`` (else it connects).

    vLLM (``ZmqEventPublisher._is_bind_endpoint``): binds for ``*``, ``::``, ipc,
    inproc. SGLang: also ``0.0.0.0``, or when its ``bind`` key is true. ``motor sim``
    always binds.
    """
    if engine == "sim":
        return True
    if bind_flag:
        return True
    if endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "::" in endpoint:
        return True
    return engine == "sglang" and "0.0.0.0" in endpoint


def subscriber_address(engine: str, endpoint: str, host: str, replay: str | None = None,
                       bind_flag: bool | None = None) -> KvEventsAddress:
    """The subscriber's :class:`KvEventsAddress` for an engine's configured publisher
    ``endpoint`` (wildcard hosts replaced by ``host``, the engine's address)."""
    binds = publisher_binds(engine, endpoint, bind_flag)

    def concrete(ep: str) -> str:
        for wild in ("*", "0.0.0.0", "[::]", "::"):
            ep = ep.replace(f"//{wild}:", f"//{host}:")
        return ep
    return KvEventsAddress(concrete(endpoint), not binds, concrete(replay) if replay else None)


@functools.lru_cache(maxsize=1024)
def adapter_salt(lora: str | None) -> int:
    """The ``extra`` of motor's block hashes for blocks computed under a LoRA adapter
    (:func:`motor._fast.hashing.block_hashes`): 0 for the base model, else a stable 64-bit
    value of the adapter's name (BLAKE2b, never 0), so an adapter's blocks and the base
    model's never share a hash (vLLM salts its own block hashes with the LoRA name the same
    way, vLLM PR #27211). Engine events name the adapter (``lora_name``); requests name it as
    their ``model``."""
    if not lora:
        return 0
    v = int.from_bytes(hashlib.blake2b(lora.encode(), digest_size=8).digest(), "little")
    return v or 1
