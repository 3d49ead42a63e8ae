"""The simulator's engine: a continuous-batching step loop over a paged KV cache.

One asyncio task runs the loop (:meth:`Engine.run`). Each step it

1. schedules: the running sequences first (one token each when decoding, a prefill
   chunk otherwise), then waiting sequences while ``max_num_seqs`` and the
   ``max_num_batched_tokens`` budget allow (chunked prefill); a sequence that needs
   a KV block when none is free preempts the most recently admitted running one
   (recompute, like vLLM);
2. sleeps for the step's simulated duration
   ``(step_fixed_ms + prefill_token_us * prefill tokens + decode_token_us * decode
   sequences) * time_scale`` (times the ``slow`` fault factor);
3. applies the step: advances computed tokens, enters newly full blocks into the
   prefix cache, and gives every sequence whose tokens are all computed its next
   token; then wakes the requests that have news (streams every step, non-streams
   when done).

When nothing is waiting or running, the loop waits on an event: an idle engine
costs no CPU. A sequence is one choice of one prompt (vLLM runs ``n`` > 1 and
prompt batches as separate engine requests too); a :class:`EngineRequest` groups
the sequences of one HTTP request.

Generated text is deterministic: a sequence's tokens come from a PRNG seeded with
(the request's seed, or else a hash of its request id; the global ``--seed``; the
prompt's tokens; the choice index). Tokens are printable ASCII bytes, one character
each, and never EOS unless ``eos_prob`` > 0.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import zlib
from collections import deque
from dataclasses import dataclass
from collections.abc import Callable, Sequence as Seq

from motor.protocol.chat_tokenizer import IM_END_ID
from motor.sim.kv import BlockPool, hash_block, lora_root
from motor.sim.metrics import SimMetrics

logger = logging.getLogger(__name__)

# Generated characters: a 64-character alphabet (letters, spaces, punctuation, digits) read
# through a 256-entry table, so a random byte maps uniformly onto it.
_ALPHABET = b"abcdefghijklmnopqrstuvwxyzetaoin        ABCDEFGHIJ.,;:!?'-012345"
assert len(_ALPHABET) == 64
_GEN_TABLE = bytes(_ALPHABET[i % 64] for i in range(256))
_GEN_CHUNK = 64

WAITING, RUNNING, FINISHED = 0, 1, 2


@dataclass
class EngineConfig:
    max_model_len: int = 4096
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    time_scale: float = 1.0
    step_fixed_ms: float = 2.0
    prefill_token_us: float = 20.0
    decode_token_us: float = 50.0
    seed: int = 0
    enable_prefix_caching: bool = True
    eos_prob: float = 0.0
    # issue 7 (fault tests): each token a function of (seed, whole context) -- see context_state
    context_keyed_text: bool = False
    record_kv_events: bool = False


@dataclass
class SamplingSpec:
    """What the engine needs of a request's sampling parameters."""
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    seed: int | None = None


class Sequence:
    """One generated choice: prompt + output tokens, KV blocks, output state."""

    __slots__ = ("req", "index", "prompt_len", "tokens", "num_computed", "blocks", "hashes",
                 "num_cached_blocks", "cached_tokens", "text", "finish_reason", "stop_reason",
                 "status", "max_tokens", "first_scheduled", "first_token_time", "last_token_time",
                 "rng", "gen", "gen_pos", "sent_tokens", "sent_text", "dirty", "holdback",
                 "prefix_checked", "recompute_after", "ctx")

    def __init__(self, req: EngineRequest, index: int, prompt: list[int], max_tokens: int,
                 seed_material: str, holdback: int) -> None:
        self.req = req
        self.index = index
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.num_computed = 0
        self.blocks: list[int] = []
        self.hashes: list[int] = []
        self.num_cached_blocks = 0
        self.cached_tokens = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.status = WAITING
        self.max_tokens = max_tokens
        self.first_scheduled = 0.0
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.rng = random.Random(seed_material)
        self.gen = b""
        self.gen_pos = 0
        self.sent_tokens = 0   # output tokens already handed to the client
        self.sent_text = 0     # output characters already handed to the client
        self.dirty = False
        self.holdback = holdback
        self.prefix_checked = False
        self.recompute_after: int | None = None
        self.ctx: int | None = None   # context-keyed text state (see context_state)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def visible_text_len(self) -> int:
        """Characters of output text that may be streamed now (stop-string hold-back)."""
        if self.status == FINISHED or not self.holdback:
            return len(self.text)
        return max(self.sent_text, len(self.text) - self.holdback)

    def next_token(self) -> int:
        if self.ctx is not None:
            h = self.ctx
            t = _GEN_TABLE[(_mix64(h) >> 24) & 0xFF]
            self.ctx = _roll(h, t)
            return t
        if self.gen_pos >= len(self.gen):
            self.gen = self.rng.randbytes(_GEN_CHUNK).translate(_GEN_TABLE)
            self.gen_pos = 0
        t = self.gen[self.gen_pos]
        self.gen_pos += 1
        return t


class EngineRequest:
    """The sequences of one HTTP request and the wake-up channel to its handler."""

    __slots__ = ("id", "seqs", "stream", "sampling", "arrival", "dirty", "waiter", "done",
                 "num_unfinished", "pending", "aborted", "lora_name", "kv_loaded")

    def __init__(self, request_id: str, stream: bool, sampling: SamplingSpec,
                 lora_name: str | None = None) -> None:
        self.id = request_id
        #: the LoRA adapter the request runs under (None: the base model); its blocks hash
        #: apart (motor.sim.kv.lora_root)
        self.lora_name = lora_name
        self.seqs: list[Sequence] = []
        self.stream = stream
        self.sampling = sampling
        self.arrival = time.monotonic()
        self.dirty: list[Sequence] = []
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.num_unfinished = 0
        self.pending = False
        self.aborted = False
        #: the prompts' KV came from a prefill instance (a PD pull / push / rendezvous):
        #: their whole blocks but the last token count as computed at the first schedule,
        #: as vLLM's connector reports them (num_external_computed_tokens), and are cached
        self.kv_loaded = False

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Wait until some sequence has news (streams) or all are finished."""
        if self.dirty or self.done:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take_dirty(self) -> list[Sequence]:
        out, self.dirty = self.dirty, []
        for s in out:
            s.dirty = False
        return out


_M64 = (1 << 64) - 1


def _roll(h: int, t: int) -> int:
    """FNV-1a step over one token id."""
    return ((h ^ t) * 0x100000001B3) & _M64


def _mix64(h: int) -> int:
    """splitmix64 finaliser."""
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
    return h ^ (h >> 31)


def context_state(seed: int | None, request_id: str, global_seed: int, prompt: Seq[int],
                  index: int) -> int:
    """Start state of context-keyed text (``--context-keyed-text``): each generated token is a
    function of (request seed or id, ``--seed``, choice index, every token before it), like
    greedy decoding of a real model. A request continued elsewhere with prompt + the tokens
    generated so far (motor's mid-stream failover) therefore goes on with the very tokens
    the first instance would have produced."""
    base = f"s{seed}" if seed is not None else f"r{zlib.crc32(request_id.encode())}"
    h = zlib.crc32(f"{base}:{global_seed}:{index}".encode()) | (1 << 40)
    for t in prompt:
        h = _roll(h, t)
    return h


def seed_material(seed: int | None, request_id: str, global_seed: int, prompt: Seq[int],
                  index: int) -> str:
    base = f"s{seed}" if seed is not None else f"r{zlib.crc32(request_id.encode())}"
    return f"{base}:{global_seed}:{zlib.crc32(bytes(t & 0xFF for t in prompt))}:{len(prompt)}:{index}"


class Engine:
    """The step loop. All methods run on the event loop thread."""

    def __init__(self, cfg: EngineConfig, metrics: SimMetrics | None = None,
                 on_kv_events: Callable[[list[tuple]], None] | None = None) -> None:
        if cfg.num_gpu_blocks * cfg.block_size < cfg.max_model_len:
            raise ValueError(
                f"the KV cache ({cfg.num_gpu_blocks} blocks of {cfg.block_size} tokens = "
                f"{cfg.num_gpu_blocks * cfg.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={cfg.max_model_len} tokens; raise --num-gpu-blocks or lower "
                f"--max-model-len")
        self.cfg = cfg
        self.metrics = metrics
        self.pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching,
                              record_events=cfg.record_kv_events)
        self.on_kv_events = on_kv_events
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._unhang = asyncio.Event()
        self._unhang.set()
        self.slow_factor = 1.0
        self.task: asyncio.Task[None] | None = None
        self.dead = False
        # counters for /admin/stats
        self.num_steps = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_preemptions = 0
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        #: prompt tokens whose KV came from a prefill instance (EngineRequest.kv_loaded)
        self.num_loaded_tokens = 0
        #: high-water marks: sequences in the running batch, and sequences held at once
        #: (running + waiting: what a gateway's per-instance cap bounds)
        self.max_running = 0
        self.max_held = 0

    # -- control ------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run_guarded(),
                                                           name="motor-sim-engine")

    async def _run_guarded(self) -> None:
        """:meth:`run`; if it dies, every unfinished sequence ends with ``error``."""
        try:
            await self.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the engine loop died")
            self.dead = True
            now = time.monotonic()
            for s in list(self.waiting) + list(self.running):
                if s.status != FINISHED:
                    self._finish(s, "error", None, now)
            self.waiting.clear()
            self.running.clear()

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done() and not self.dead

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass

    def set_hang(self, hang: bool) -> None:
        if hang:
            self._unhang.clear()
        else:
            self._unhang.set()

    @property
    def hanging(self) -> bool:
        return not self._unhang.is_set()

    def submit(self, req: EngineRequest) -> None:
        for s in req.seqs:
            self.waiting.append(s)
        held = len(self.waiting) + len(self.running)
        if held > self.max_held:
            self.max_held = held
        req.num_unfinished = len(req.seqs)
        if not req.seqs:
            req.done = True
        self._wake.set()

    def abort(self, req: EngineRequest) -> None:
        """Stop all unfinished sequences of ``req`` now and free their KV blocks."""
        if req.done:
            return
        req.aborted = True
        self.num_aborted += 1
        logger.debug("Request %s aborted.", req.id)
        for s in req.seqs:
            if s.status == WAITING:
                try:
                    self.waiting.remove(s)
                except ValueError:
                    pass
            elif s.status == RUNNING:
                try:
                    self.running.remove(s)
                except ValueError:
                    pass
            if s.status != FINISHED:
                self._finish(s, "abort", None, time.monotonic())
        self._wake.set()

    # -- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        fixed_s = cfg.step_fixed_ms * 1e-3
        prefill_s = cfg.prefill_token_us * 1e-6
        decode_s = cfg.decode_token_us * 1e-6
        while True:
            if not self._unhang.is_set():
                await self._unhang.wait()
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = loop.time()
            scheduled, n_prefill, n_decode = self._schedule(t0)
            if not scheduled:
                self._wake.clear()
                await self._wake.wait()
                continue
            scale = cfg.time_scale * self.slow_factor
            if scale > 0:
                dt = (fixed_s + prefill_s * n_prefill + decode_s * n_decode) * scale
                delay = t0 + dt - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                await asyncio.sleep(0)
            if not self._unhang.is_set():  # a hang fault freezes the step in flight
                await self._unhang.wait()
            self._apply(scheduled, time.monotonic())
            self.num_steps += 1
            if self.on_kv_events is not None and self.pool.events:
                self.on_kv_events(self.pool.take_events())

    def _ensure_blocks(self, s: Sequence, upto: int) -> bool:
        bs = self.cfg.block_size
        need = (upto + bs - 1) // bs - len(s.blocks)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        s.blocks.extend(got)
        return True

    def _preempt(self, s: Sequence) -> None:
        self.pool.release(s.blocks)
        s.blocks = []
        s.num_computed = 0
        s.num_cached_blocks = 0
        s.prefix_checked = False
        s.status = WAITING
        self.waiting.appendleft(s)
        self.num_preemptions += 1
        if self.metrics is not None:
            self.metrics.num_preemptions.inc()

    def _prefix_lookup(self, s: Sequence) -> list[int]:
        """Cache-hit blocks for a sequence with nothing computed (counted in the metrics)."""
        bs = self.cfg.block_size
        n_tokens = len(s.tokens)
        hits: list[int] = []
        if self.cfg.enable_prefix_caching:
            # at least the last token must be computed, so never hit on it
            max_blocks = (n_tokens - 1) // bs
            self._extend_hashes(s, max_blocks)
            hits = self.pool.lookup(s.hashes[:max_blocks])
            self.num_prefix_queries += n_tokens
            self.num_prefix_hits += len(hits) * bs
            if self.metrics is not None:
                self.metrics.prefix_cache_queries.inc(n_tokens)
                if hits:
                    self.metrics.prefix_cache_hits.inc(len(hits) * bs)
        return hits

    def cached_prefix_blocks(self, tokens: Seq[int], lora_name: str | None = None) -> int:
        """Whole blocks of ``tokens`` (the last token left out, as a schedule does) that are
        in the prefix cache now, from the first; a lookup that changes nothing. A KV
        connector reads only the blocks past this local hit (vLLM's NixlConnector:
        "partial prefix cache hit: just read uncomputed blocks")."""
        if not self.cfg.enable_prefix_caching:
            return 0
        bs = self.cfg.block_size
        cached = self.pool.cached
        h = lora_root(lora_name)
        for k in range((len(tokens) - 1) // bs):
            h = hash_block(h, tokens[k * bs:(k + 1) * bs])
            if h not in cached:
                return k
        return max(0, (len(tokens) - 1) // bs)

    def _extend_hashes(self, s: Sequence, n_blocks: int) -> None:
        hashes, tokens, bs = s.hashes, s.tokens, self.cfg.block_size
        k = len(hashes)
        parent = hashes[-1] if hashes else lora_root(s.req.lora_name)
        while k < n_blocks:
            parent = hash_block(parent, tokens[k * bs:(k + 1) * bs])
            hashes.append(parent)
            k += 1

    def _schedule(self, now: float) -> tuple[list[tuple[Sequence, int]], int, int]:
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        n_prefill = n_decode = 0
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            num_new = len(s.tokens) - s.num_computed
            if num_new > budget:
                num_new = budget
            while not self._ensure_blocks(s, s.num_computed + num_new):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is s:
                    s = None  # type: ignore[assignment]
                    break
            if s is None:
                break
            scheduled.append((s, num_new))
            budget -= num_new
            if num_new == 1 and s.num_computed >= s.prompt_len:
                n_decode += 1
            else:
                n_prefill += num_new
            i += 1
        if not preempted:
            waiting = self.waiting
            pool = self.pool
            while waiting and len(running) < cfg.max_num_seqs and budget > 0:
                s = waiting[0]
                hits: list[int] = []
                if s.num_computed == 0 and not s.blocks:
                    hits = self._prefix_lookup(s)
                    if hits:
                        pool.touch(hits)
                        s.blocks = list(hits)
                        s.num_computed = len(hits) * cfg.block_size
                        s.num_cached_blocks = len(hits)
                    if s.req.kv_loaded and s.first_scheduled == 0.0:
                        # loaded, not computed: blocks for them are allocated below
                        loaded = (s.prompt_len - 1) // cfg.block_size * cfg.block_size
                        if loaded > s.num_computed:
                            self.num_loaded_tokens += loaded - s.num_computed
                            s.num_computed = loaded
                    if not s.prefix_checked:
                        s.prefix_checked = True
                        if s.first_scheduled == 0.0:
                            s.cached_tokens = s.num_computed
                num_new = len(s.tokens) - s.num_computed
                if num_new > budget:
                    num_new = budget
                if not self._ensure_blocks(s, s.num_computed + num_new):
                    # undo: give the hits back, try again next step
                    pool.release(s.blocks)
                    s.blocks = []
                    s.num_computed = 0
                    s.num_cached_blocks = 0
                    s.prefix_checked = False
                    break
                waiting.popleft()
                s.status = RUNNING
                if s.first_scheduled == 0.0:
                    s.first_scheduled = now
                    if self.metrics is not None:
                        self.metrics.request_queue_time.observe(
                            max(0.0, time.monotonic() - s.req.arrival))
                running.append(s)
                scheduled.append((s, num_new))
                budget -= num_new
                n_prefill += num_new
        if len(running) > self.max_running:
            self.max_running = len(running)
        return scheduled, n_prefill, n_decode

    def _apply(self, scheduled: list[tuple[Sequence, int]], now: float) -> None:
        cfg = self.cfg
        bs = cfg.block_size
        pool = self.pool
        metrics = self.metrics
        caching = cfg.enable_prefix_caching
        touched: list[EngineRequest] = []
        n_generated = 0
        n_prompt = 0
        any_finished = False
        for s, num_new in scheduled:
            if s.status != RUNNING:  # aborted during the step
                continue
            s.num_computed += num_new
            if caching:
                full = s.num_computed // bs
                nc = s.num_cached_blocks
                if full > nc:
                    self._extend_hashes(s, full)
                    pool.cache_blocks(s.blocks[nc:full], s.hashes[nc:full],
                                      s.hashes[nc - 1] if nc else None,
                                      s.tokens[nc * bs:full * bs], s.req.lora_name)
                    s.num_cached_blocks = full
            if s.num_computed < len(s.tokens):
                continue  # prefill chunk, more to come
            # all tokens computed: sample the next one
            if s.first_token_time == 0.0:
                n_prompt += s.prompt_len
            n_generated += self._emit(s, now)
            if s.status == FINISHED:
                any_finished = True
            req = s.req
            if not s.dirty:
                s.dirty = True
                req.dirty.append(s)
            if not req.pending:
                req.pending = True
                touched.append(req)
        if any_finished:
            self.running = [s for s in self.running if s.status == RUNNING]
        for req in touched:
            req.pending = False
            if req.stream or req.done:
                req.wake()
        if metrics is not None:
            if n_generated:
                metrics.generation_tokens.inc(n_generated)
            if n_prompt:
                metrics.prompt_tokens.inc(n_prompt)

    def _emit(self, s: Sequence, now: float) -> int:
        """Give ``s`` its next token (or finish it); returns the number of tokens produced."""
        sp = s.req.sampling
        metrics = self.metrics
        n_out = len(s.tokens) - s.prompt_len
        if s.recompute_after is not None and n_out >= s.recompute_after:
            # vLLM-Ascend's recompute scheduler: the request ends with no further token
            self._finish(s, "stop", "recomputed", now)
            return 0
        if metrics is not None:
            if s.first_token_time == 0.0:
                metrics.time_to_first_token.observe(now - s.req.arrival)
            else:
                metrics.inter_token_latency.observe(now - s.last_token_time)
        if s.first_token_time == 0.0:
            s.first_token_time = now
        s.last_token_time = now
        eos = (self.cfg.eos_prob > 0 and not sp.ignore_eos and n_out >= sp.min_tokens
               and s.rng.random() < self.cfg.eos_prob)
        tok = IM_END_ID if eos else s.next_token()
        s.tokens.append(tok)
        n_out += 1
        if eos:
            self._finish(s, "stop", None, now)
            return 1
        if sp.stop_token_ids and tok in sp.stop_token_ids and n_out > sp.min_tokens:
            if sp.include_stop_str_in_output:
                s.text += chr(tok)
            self._finish(s, "stop", tok, now)
            return 1
        s.text += chr(tok)
        if sp.stop and n_out > sp.min_tokens:
            text = s.text
            for stop in sp.stop:
                if text.endswith(stop):
                    if not sp.include_stop_str_in_output:
                        s.text = text[:-len(stop)]
                    self._finish(s, "stop", stop, now)
                    return 1
        if n_out >= s.max_tokens or len(s.tokens) >= self.cfg.max_model_len:
            self._finish(s, "length", None, now)
        return 1

    def _finish(self, s: Sequence, reason: str, stop_reason: int | str | None,
                now: float) -> None:
        s.status = FINISHED
        s.finish_reason = reason
        s.stop_reason = stop_reason
        if s.blocks:
            self.pool.release(s.blocks)
            s.blocks = []
        req = s.req
        req.num_unfinished -= 1
        self.num_finished += 1
        m = self.metrics
        if m is not None:
            m.request_success[reason].inc()
            m.e2e_request_latency.observe(now - req.arrival)
            m.request_prompt_tokens.observe(s.prompt_len)
            m.request_generation_tokens.observe(len(s.tokens) - s.prompt_len)
            if s.first_token_time:
                m.request_prefill_time.observe(max(0.0, s.first_token_time - s.first_scheduled))
                m.request_decode_time.observe(now - s.first_token_time)
        if req.num_unfinished <= 0:
            req.done = True
            req.wake()
        elif reason == "abort":
            req.wake()

    # -- introspection ------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "max_running": self.max_running,
            "max_held": self.max_held,
            "finished": self.num_finished,
            "aborted": self.num_aborted,
            "preemptions": self.num_preemptions,
            "steps": self.num_steps,
            "kv_usage": self.pool.usage,
            "kv_free_blocks": self.pool.num_free,
            "kv_cached_blocks": len(self.pool.cached),
            "prefix_cache_queries": self.num_prefix_queries,
            "prefix_cache_hits": self.num_prefix_hits,
            "kv_loaded_tokens": self.num_loaded_tokens,
            "alive": self.alive,
            "hanging": self.hanging,
            "slow_factor": self.slow_factor,
        }
