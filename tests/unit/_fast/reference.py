"""Pure-Python reference models of ``motor._fast`` (hashing, radix, scoring, ring, sse).

Written straight from the docstrings / ``docs/fast.md``, for clarity not speed.
The compiled modules must agree with these on every input.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1

# ---------------------------------------------------------------- hashing

_M = (0x6CC6BE1805FDF179, 0x4BA71AB7AC0504A5, 0xDAE85D0928398F9F, 0x0B8E90E9F6466D5F)
_S = (0xC4E08E67B822B63B, 0x28B58AB4D47A9A79, 0x25318BF27B885975, 0x3D3DB70B0D99ED21)
_MC = 0x87A152F460CA36FF
_MP = 0x167DD69A83F614DD
_ME = 0xFDA536A3A434D6F9
_MLEN = 0x9D4615766CD44F91
HASH_ZERO_REMAP = 0x2545F4914F6CDD1D


def _xs32(x: int) -> int:
    return x ^ (x >> 32)


def mix13(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def content_hash(tokens: list[int], extra: int = 0) -> int:
    """Content hash of one block (before the parent is folded in)."""
    e = (extra * _ME) & MASK64
    lanes = [s ^ e for s in _S]
    words = [tokens[i] | (tokens[i + 1] << 32) for i in range(0, len(tokens) - 1, 2)]
    if len(tokens) % 2:
        words.append(tokens[-1])
    for j, w in enumerate(words):
        lane = j % 4
        lanes[lane] = _xs32(((lanes[lane] ^ w) * _M[lane]) & MASK64)
    c = (len(tokens) * _MLEN) & MASK64
    for a in lanes:
        c = _xs32(((c ^ a) * _MC) & MASK64)
    return c


def hash_block(parent: int, tokens: list[int], extra: int = 0) -> int:
    if not tokens:
        raise ValueError("tokens is expected to hold one block (>= 1 token), got 0")
    h = mix13(content_hash(list(tokens), extra) ^ ((parent * _MP) & MASK64))
    return h if h else HASH_ZERO_REMAP


def block_hashes(tokens, block_size: int, parent: int = 0, extra: int = 0) -> list[int]:
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    tokens = [int(t) for t in tokens]
    out = []
    h = parent
    for k in range(len(tokens) // block_size):
        h = hash_block(h, tokens[k * block_size:(k + 1) * block_size], extra)
        out.append(h)
    return out


# ---------------------------------------------------------------- radix

TIER_DEVICE, TIER_HOST, TIER_DISK = 0, 1, 2
N_TIERS = 3


class PrefixIndex:
    """Reference prefix index: dict block hash -> {instance: set(tiers)} + LRU dict."""

    def __init__(self, max_instances: int = 256) -> None:
        if not 1 <= max_instances <= 256:
            raise ValueError(f"max_instances is expected to be in 1..256, got {max_instances}")
        self.max_instances = max_instances
        self.nodes: dict[int, dict[int, set[int]]] = {}
        self.ts: dict[int, float] = {}  # insertion order == LRU order (oldest first)
        self.last_store_time = -math.inf
        self.n_orphan_stores = 0

    # helpers
    def _check(self, instance: int, tier: int | None = None) -> None:
        if not 0 <= instance < self.max_instances:
            raise ValueError(f"instance is expected to be in 0..{self.max_instances - 1}, "
                             f"got {instance}")
        if tier is not None and not 0 <= tier < N_TIERS:
            raise ValueError(f"tier is expected to be 0 (device), 1 (host) or 2 (disk), got {tier}")

    def _free(self, h: int) -> None:
        del self.nodes[h]
        del self.ts[h]

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_blocks(self) -> int:
        return sum(len(ts) for holders in self.nodes.values() for ts in holders.values())

    def instance_blocks(self, instance: int) -> int:
        self._check(instance)
        return sum(len(h.get(instance, ())) for h in self.nodes.values())

    def store(self, instance, tier, parent_hash, block_hashes, now=0.0) -> int:
        self._check(instance, tier)
        hs = [int(h) for h in block_hashes]
        if any(h == 0 for h in hs):
            raise ValueError("block_hashes[k] is expected to be non-zero")
        if parent_hash != 0 and instance not in self.nodes.get(parent_hash, {}):
            self.n_orphan_stores += 1
        self.last_store_time = max(self.last_store_time, now)
        added = 0
        for h in reversed(hs):
            holders = self.nodes.setdefault(h, {})
            self.ts.pop(h, None)
            self.ts[h] = self.last_store_time
            tiers = holders.setdefault(instance, set())
            if tier not in tiers:
                tiers.add(tier)
                added += 1
        return added

    def remove(self, instance, tier, block_hashes) -> int:
        self._check(instance, tier)
        removed = 0
        for h in (int(x) for x in block_hashes):
            holders = self.nodes.get(h)
            if holders is None or tier not in holders.get(instance, ()):
                continue
            holders[instance].discard(tier)
            removed += 1
            if not holders[instance]:
                del holders[instance]
            if not holders:
                self._free(h)
        return removed

    def clear(self, instance) -> int:
        self._check(instance)
        removed = 0
        for h in list(self.nodes):
            tiers = self.nodes[h].pop(instance, None)
            if tiers:
                removed += len(tiers)
            if not self.nodes[h]:
                self._free(h)
        return removed

    def evict_older_than(self, cutoff) -> int:
        victims = [h for h, t in self.ts.items() if t < cutoff]
        for h in victims:
            self._free(h)
        return len(victims)

    def evict_to_cap(self, max_nodes) -> int:
        if max_nodes < 0:
            raise ValueError(f"max_nodes is expected to be >= 0, got {max_nodes}")
        count = 0
        while len(self.nodes) > max_nodes:
            self._free(next(iter(self.ts)))
            count += 1
        return count

    def match(self, block_hashes) -> list[list[int]]:
        """out[i][t] = blocks of i's leading any-tier run whose fastest tier is t."""
        out = [[0] * N_TIERS for _ in range(self.max_instances)]
        for i in range(self.max_instances):
            for h in (int(x) for x in block_hashes):
                tiers = self.nodes.get(h, {}).get(i)
                if not tiers:
                    break
                out[i][min(tiers)] += 1
        return out

    def holders(self, block_hash) -> list[tuple[int, int]]:
        return sorted((i, t) for i, ts in self.nodes.get(block_hash, {}).items() for t in ts)

    def lru_hashes(self) -> list[int]:
        return list(self.ts)


# ---------------------------------------------------------------- scoring

def score_costs(overlap, prompt_tokens, block_size, tier_credit, prefill_tokens,
                decode_tokens, queue, candidates=None, w_prefill=1.0, w_decode=0.0,
                w_queue=0.0, guard_factor=0.0, guard_min_load=0.0):
    """Per-candidate (cost, load) in candidate order."""
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
    n = len(overlap)
    cands = list(range(n)) if candidates is None else [int(c) for c in candidates]
    for j, c in enumerate(cands):
        if not 0 <= c < n:
            raise ValueError(f"candidates[{j}] is expected to be in 0..{n - 1}, got {c}")
    loads = [w_prefill * float(prefill_tokens[i]) + w_decode * float(decode_tokens[i])
             + w_queue * float(queue[i]) for i in cands]
    # the guard: load_i > g x the mean load of the *other* candidates, i.e.
    # load_i > g * (total - load_i) / (k - 1), which is load_i > g * total / (k - 1 + g)
    guard = math.inf
    if guard_factor > 0 and len(cands) > 1 and max(loads) > guard_min_load:
        guard = guard_factor * sum(loads) / (len(cands) - 1 + guard_factor)
    result = []
    for i, load in zip(cands, loads):
        saved = sum(block_size * float(tier_credit[t]) * int(overlap[i][t]) for t in range(3))
        if load > guard:
            saved = 0.0
        result.append((max(prompt_tokens - saved, 0.0) + load, load))
    return cands, result


def pick(*args, start=0, **kwargs):
    cands, result = score_costs(*args, **kwargs)
    if not cands:
        return -1, math.inf
    k = len(cands)
    order = [(start % k + q) % k for q in range(k)]
    # min over (cost, load, rotation rank)
    best = min(range(k), key=lambda r: (result[order[r]][0], result[order[r]][1], r))
    pos = order[best]
    return cands[pos], result[pos][0]


def ttft_costs(overlap, prompt_tokens, block_size, tier_credit, queued_tokens, running,
               rates, candidates=None, chunk_tokens=8192.0):
    """Per-candidate (predicted TTFT in s, queued time in s) in candidate order
    (``scoring.pick_ttft``'s model)."""
    if block_size <= 0:
        raise ValueError(f"block_size is expected to be > 0, got {block_size}")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens is expected to be >= 0, got {prompt_tokens}")
    if not chunk_tokens > 0:
        raise ValueError(f"chunk_tokens is expected to be > 0, got {chunk_tokens}")
    n = len(overlap)
    cands = list(range(n)) if candidates is None else [int(c) for c in candidates]
    result = []
    for i in cands:
        step_s, pre_s, dec_s = (float(v) for v in rates[i])
        saved = sum(block_size * float(tier_credit[t]) * int(overlap[i][t]) for t in range(3))
        work = float(queued_tokens[i]) + max(prompt_tokens - saved, 0.0)
        steps = max(1.0, float(math.ceil(work / chunk_tokens)))
        run = float(running[i])
        result.append((steps * (step_s + dec_s * run) + pre_s * work,
                       pre_s * float(queued_tokens[i]) + dec_s * run))
    return cands, result


def pick_ttft(*args, start=0, **kwargs):
    """(instance, predicted TTFT): min over (TTFT, queued time, rotation rank)."""
    kwargs.pop("out", None)
    cands, result = ttft_costs(*args, **kwargs)
    if not cands:
        return -1, math.inf
    k = len(cands)
    order = [(start % k + q) % k for q in range(k)]
    best = min(range(k), key=lambda r: (result[order[r]][0], result[order[r]][1], r))
    pos = order[best]
    return cands[pos], result[pos][0]


# ---------------------------------------------------------------- ring

RECORD_PAD, RECORD_OVERFLOW, RECORD_USER = 0, 1, 16


def _total(n: int) -> int:
    return 8 + ((n + 7) & ~7)


@dataclass
class Ring:
    """Reference SPSC ring: same byte layout and space rules, one process, no atomics."""

    capacity: int
    data: bytearray = field(init=False)
    head: int = 0
    tail: int = 0
    overflows: int = 0
    pending_drops: int = 0

    def __post_init__(self) -> None:
        if self.capacity < 64 or self.capacity & (self.capacity - 1):
            raise ValueError("capacity_bytes is expected to be a power of two in 64..2**40")
        self.data = bytearray(self.capacity)

    @property
    def used_bytes(self) -> int:
        return self.tail - self.head

    def _reserve(self, t: int, total: int):
        off = t % self.capacity
        contiguous = self.capacity - off
        need = total if total <= contiguous else contiguous + total
        if t + need - self.head > self.capacity:
            return None
        if total > contiguous:
            self.data[off:off + 8] = struct.pack("<II", contiguous - 8, RECORD_PAD)
            t += contiguous
            off = 0
        return off, t + total

    def _write(self, off: int, rtype: int, payload: bytes) -> None:
        total = _total(len(payload))
        self.data[off:off + total] = (struct.pack("<II", len(payload), rtype) + payload
                                      + bytes(total - 8 - len(payload)))

    def _push(self, rtype: int, payload: bytes, count_drop: bool) -> bool:
        payload = bytes(payload)
        if not RECORD_USER <= rtype <= 0xFFFFFFFF:
            raise ValueError("record_type is expected to be in 16..2**32-1")
        if _total(len(payload)) > self.capacity // 2:
            raise ValueError("payload is expected to be <= capacity // 2 - 8 bytes")
        t = self.tail
        marker = None
        if self.pending_drops:
            r = self._reserve(t, 16)
            if r is None:
                rec = None
            else:
                marker, t = r
                rec = self._reserve(t, _total(len(payload)))
        else:
            rec = self._reserve(t, _total(len(payload)))
        if rec is None:
            if count_drop:
                self.pending_drops += 1
                self.overflows += 1
            return False
        if marker is not None:
            self._write(marker, RECORD_OVERFLOW, struct.pack("<Q", self.pending_drops))
            self.pending_drops = 0
        off, t = rec
        self._write(off, rtype, payload)
        self.tail = t
        return True

    def push(self, rtype, payload) -> bool:
        return self._push(rtype, payload, True)

    def try_push(self, rtype, payload) -> bool:
        return self._push(rtype, payload, False)

    def push_many(self, rtype, payloads) -> int:
        n = 0
        for p in payloads:
            if not self._push(rtype, p, False):
                break
            n += 1
        return n

    def _next(self, h: int):
        while h != self.tail:
            off = h % self.capacity
            length, rtype = struct.unpack_from("<II", self.data, off)
            if rtype == RECORD_PAD:
                h += 8 + length
                continue
            return h, off, length, rtype
        return None

    def peek(self):
        r = self._next(self.head)
        if r is None:
            return None
        _, off, length, rtype = r
        return rtype, bytes(self.data[off + 8:off + 8 + length])

    def pop(self):
        r = self._next(self.head)
        if r is None:
            return None
        h, off, length, rtype = r
        self.head = h + _total(length)
        return rtype, bytes(self.data[off + 8:off + 8 + length])

    def pop_many(self, max_records=1024):
        out = []
        while len(out) < max_records:
            r = self.pop()
            if r is None:
                break
            out.append(r)
        return out


# ---------------------------------------------------------------- sse

_SSE_INT_LIMIT = 10 ** 18          # the compiled scanner's integer part: at most 18 digits
_SSE_REASONING = ("reasoning_content", "tool_calls", "reasoning")


class _SseUnsure(Exception):
    """An event the scanner leaves to the JSON path."""


def _sse_ids(v: object) -> list[int]:
    if not isinstance(v, list) or not all(
            type(x) is int and 0 <= x < _SSE_INT_LIMIT for x in v):
        raise _SseUnsure
    return v


def _sse_scalar(obj: dict, key: str) -> object:
    v = obj.get(key)
    if v is None or type(v) is str or (type(v) is int and v >= 0):
        return v
    raise _SseUnsure


class EventScanner:
    """Reference of ``motor._fast.sse.EventScanner``: the same decisions on events decoded
    with orjson, written from ``StreamRecovery._event`` (first leg) and the scanner's
    docstring. It has none of the compiled scanner's lexical limits (escapes, number
    sizes, member counts): where the compiled one answers ``None`` for those, this one may
    answer; everywhere else they agree. Changed events are re-encoded (``data: `` +
    ``orjson.dumps``), so outputs agree as parsed JSON, not as bytes."""

    STATE = ("role_sent", "ids_missing", "blocked", "finished", "have_id", "have_prompt",
             "usage_sent", "done")

    def __init__(self, chat: bool, client_ids: bool) -> None:
        self.chat = chat
        self.client_ids = client_ids
        for k in self.STATE:
            setattr(self, k, False)
        self.resp_id = self.created = self.model = None
        self.finish_reason = None
        self.prompt_ids = None
        self.news = self.captured = False
        self.events = 0
        self.fallbacks = 0

    def sync(self, **state: bool) -> None:
        for k in self.STATE:
            setattr(self, k, bool(state[k]))

    def feed(self, block: bytes, gen: list[int]) -> bytes | None:
        import orjson
        st = {k: getattr(self, k) for k in self.STATE}
        before = dict(st)
        self._cap: dict = {}
        ids: list[int] = []
        out: list[bytes] = []
        same = block.endswith(b"\n\n")
        events = 0
        pieces = block.split(b"\n\n")
        if pieces[-1] == b"":
            pieces.pop()
        try:
            for ev in pieces:
                if b"\n" in ev:
                    raise _SseUnsure
                if not ev:
                    same = False
                    continue
                if not ev.startswith(b"data:"):
                    out.append(ev + b"\n\n")
                    continue
                payload = ev[5:].strip(b" \t\r")
                if payload.startswith(b"["):
                    if payload != b"[DONE]" or not st["finished"]:
                        raise _SseUnsure
                    st["done"] = True
                    out.append(ev + b"\n\n")
                    continue
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    raise _SseUnsure from None
                if not isinstance(obj, dict):
                    raise _SseUnsure
                res = self._event(obj, st, ids)
                if res is None:
                    same = False
                    continue
                events += 1
                if res is False:
                    out.append(ev + b"\n\n")
                else:
                    same = False
                    out.append(b"data: " + orjson.dumps(obj) + b"\n\n")
        except _SseUnsure:
            self.fallbacks += 1
            self.news = False
            return None
        gen.extend(ids)
        self.events += events
        cap = self._cap
        self.news = st != before or bool(cap)
        self.captured = "resp_id" in cap
        self.finish_reason = cap.get("finish_reason")
        self.prompt_ids = cap.get("prompt_ids")
        if self.captured:
            self.resp_id, self.created, self.model = cap["resp_id"], cap["created"], cap["model"]
        for k, v in st.items():
            setattr(self, k, v)
        return block if same else b"".join(out)

    def _event(self, obj: dict, st: dict, ids: list[int]) -> bool | None:
        """Edit ``obj`` in place; True: changed, False: as it came, None: dropped."""
        cap = self._cap
        if "error" in obj:
            raise _SseUnsure
        if not st["have_id"]:
            cap["resp_id"] = rid = _sse_scalar(obj, "id")
            cap["created"] = _sse_scalar(obj, "created")
            cap["model"] = _sse_scalar(obj, "model")
            st["have_id"] = rid is not None
        changed = False
        pids = obj.get("prompt_token_ids")
        if isinstance(pids, list):
            _sse_ids(pids)                           # arrays are parsed in both modes
        elif pids is not None and self.chat:
            raise _SseUnsure
        if pids is not None and self.chat:
            if not st["have_prompt"]:
                st["have_prompt"] = True
                cap["prompt_ids"] = list(pids)
            if not self.client_ids or st["role_sent"]:
                del obj["prompt_token_ids"]
                obj.pop("prompt_text", None)
                changed = True
        choices = obj.get("choices")
        if choices is None or choices == []:
            if obj.get("usage") is not None:
                st["usage_sent"] = True
            return changed
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0],
                                                                                  dict):
            raise _SseUnsure
        c = choices[0]
        tids = None
        if "token_ids" in c:
            if c["token_ids"] is not None:
                tids = _sse_ids(c["token_ids"])
                ids.extend(tids)
            if not self.client_ids:
                del c["token_ids"]
                changed = True
        fr = c.get("finish_reason")
        if fr is not None and type(fr) is not str:
            raise _SseUnsure
        if c.get("stop_reason") == "recomputed":
            raise _SseUnsure
        cp = c.get("prompt_token_ids")
        if isinstance(cp, list):
            _sse_ids(cp)                             # arrays are parsed in both modes
        elif cp is not None and not self.chat:
            raise _SseUnsure
        if not self.chat:
            text = c.get("text")
            if text is not None and type(text) is not str:
                raise _SseUnsure
            if "prompt_token_ids" in c:
                if cp is not None:
                    if not st["have_prompt"]:
                        st["have_prompt"] = True
                        cap["prompt_ids"] = list(cp)
                    if not self.client_ids:
                        del c["prompt_token_ids"]
                        c.pop("prompt_text", None)
                    elif "prompt_text" in c and c["prompt_text"] is None:
                        del c["prompt_text"]
                    changed = True
                elif changed:
                    del c["prompt_token_ids"]
        else:
            delta = c.get("delta")
            if delta is None:
                delta = {}
            if not isinstance(delta, dict):
                raise _SseUnsure
            text = delta.get("content")
            if text is not None and type(text) is not str:
                raise _SseUnsure
            if "role" in delta:
                if st["role_sent"]:
                    if not text and fr is None and tids is None:
                        return None
                    del delta["role"]
                    changed = True
                st["role_sent"] = True
            if any(k in delta for k in _SSE_REASONING):
                st["blocked"] = True
        if tids is None and text:
            st["ids_missing"] = True
        if fr is not None:
            st["finished"] = True
            cap["finish_reason"] = fr
        return changed
