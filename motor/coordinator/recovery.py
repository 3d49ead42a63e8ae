"""Fault recovery on the request path: what is retried, and mid-stream failover.

Retry before the first byte (decided by :func:`retryable_status` and the caller)
------------------------------------------------------------------------------------
A request is re-sent to another endpoint (bounded by ``retries.max_attempts``, doubling
backoff capped at ``retries.backoff_max_s``) while the client has received nothing when

* the transport failed: connection refused / reset, connect timeout, a connection
  closed before or during the answer (non-streaming: the answer is read whole before
  anything is sent, so a crash mid-body is still "before the first byte");
* the endpoint left the routable set (instance removed / unhealthy) while the request
  waited for the answer's first byte;
* the engine answered a status it marks retryable: a status in
  ``retries.retry_statuses`` (default 429, 502, 503, 504) or any 5xx carrying
  ``Retry-After``. Other answers, a client's 4xx first of all, go to the client as they
  are (status, body, ``Retry-After``); when the attempts run out the last retryable
  answer goes to the client unchanged.

A first-byte timeout is not retried: the engine may be working on the request, and a
retry would double the configured wait; the client gets 504.

Mid-stream failover (:class:`StreamRecovery`)
---------------------------------------------
For a streaming request that :func:`continuable` accepts, motor asks the engine for the
token ids (vLLM's ``return_token_ids``; injected into the body, stripped again from what
the client sees unless the client asked for them) and records the prompt's token ids and
every generated token id. When the stream breaks (transport error, an engine error event,
or vLLM-Ascend's ``stop_reason: "recomputed"``), the request continues on another
instance through ``POST /v1/completions`` with ``prompt`` = prompt token ids + generated
token ids and ``max_tokens`` = what remains (``min_tokens`` too). The continuation's
chunks are rewritten so the client sees one continuous stream: same ``id``, ``created``
and ``model``; chat requests get chat chunks (``delta.content``) built from the
completion chunks (a chat continues as a completion of its templated prompt: the chat
endpoint cannot take token ids); ``usage`` counts the original prompt and every
generated token. A stream broken after its finishing chunk is ended by motor (usage
chunk if asked, ``[DONE]``).

Requests that cannot be continued exactly (see :func:`continuable`) and streams whose
engine did not return token ids end with one SSE error event and ``data: [DONE]`` when
they break after an event reached the client; before that they are restarted whole.

The first leg's events are read on the bytes (:class:`motor._fast.sse.EventScanner`:
token ids, prompt ids, ``finish_reason``, usage and ``[DONE]`` found and the token-id
fields cut without a JSON parse); a block it does not fully understand, and every event
of a continuation (rewritten: ``id``, usage, chat reshaping), takes the JSON path
(:meth:`StreamRecovery._feed_json`). Both give the client the same JSON.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from motor._fast.sse import EventScanner
from motor.protocol.openai import SSE_DONE, max_tokens_field

_loads = orjson.loads
_dumps = orjson.dumps

# vLLM's default max_tokens of /v1/completions (vllm/entrypoints/openai/protocol.py
# CompletionRequest.max_tokens = 16); chat's default is "the rest of the context", which a
# continuation gets for free by leaving max_tokens out.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# chat-only request fields that /v1/completions does not take (a chat continues as a
# completion of its templated prompt)
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "functions",
              "function_call", "chat_template", "chat_template_kwargs", "add_generation_prompt",
              "continue_final_message", "documents", "max_completion_tokens", "logprobs",
              "top_logprobs", "reasoning_effort", "echo", "mm_processor_kwargs",
              "media_io_kwargs", "include_reasoning", "add_special_tokens", "request_id")

_DONE = b"[DONE]"


def _error_status(err: Any) -> int | None:
    """The HTTP status an in-band error object carries (``code``, as vLLM and SGLang set it),
    or ``None`` when it carries none."""
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    return code if isinstance(code, int) and not isinstance(code, bool) \
        and 100 <= code <= 599 else None


def retryable_status(status: int, headers: list[tuple[bytes, bytes]],
                     retry_statuses: frozenset[int]) -> bool:
    """Whether an engine's answer ``status`` may be re-sent to another endpoint.

    Retryable: a status in ``retry_statuses``, or any 5xx that carries ``Retry-After``
    (the engine says "try again"). Never a 4xx other than 429 (when listed).
    """
    if status in retry_statuses:
        return True
    if status >= 500:
        for k, _ in headers:
            if k == b"retry-after":
                return True
    return False


def continuable(chat: bool, body: dict[str, Any]) -> str | None:
    """``None`` when a stream of this request can be continued exactly on another instance,
    else why not (logged, and said in the error event if the stream breaks).

    Not exactly continuable: several choices (``n`` > 1, ``best_of``), logprobs (the
    continuation cannot return the first part's), ``echo``, ``prompt_logprobs``, stop
    strings (the engine holds back text it may cut while the token ids run ahead),
    tools and structured outputs (parser / grammar state is not resumable), batched
    completion prompts.
    """
    if body.keys().isdisjoint(_NOT_CONTINUABLE_KEYS):     # the usual request: none of them
        return _prompt_and_length(chat, body)
    n = body.get("n")
    if n is not None and n != 1:
        return "n > 1"
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        return "best_of > 1"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):
        return "stop strings"
    if chat and (body.get("tools") or body.get("functions")):
        return "tools"
    rf = body.get("response_format")
    if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) \
            or body.get("structured_outputs") or body.get("guided_json") \
            or body.get("guided_regex") or body.get("guided_choice") or body.get("guided_grammar"):
        return "structured output"
    return _prompt_and_length(chat, body)


#: the fields :func:`continuable` reads besides the prompt and the length bound: a body
#: with none of them is refused only for those two
_NOT_CONTINUABLE_KEYS = frozenset((
    "n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "stop", "tools",
    "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar"))


def _prompt_and_length(chat: bool, body: dict[str, Any]) -> str | None:
    """:func:`continuable`'s last checks: a batched completions prompt, a length bound that
    is not an integer."""
    if not chat:
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1 or not isinstance(p[0], str):
                return "batched prompt"
    mt = max_tokens_field(body, chat)
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool)):
        return "max_tokens is not an integer"
    return None


def inject_token_ids(raw: bytes, body: dict[str, Any]) -> bytes:
    """The request body with ``return_token_ids: true`` (bytes spliced, body not re-encoded)."""
    v = body.get("return_token_ids")
    if v is True:
        return raw
    if "return_token_ids" in body:
        b = dict(body)
        b["return_token_ids"] = True
        return _dumps(b)
    return with_token_ids(raw)


def with_token_ids(raw: bytes) -> bytes:
    """A JSON object's bytes with ``"return_token_ids":true`` put first (``raw`` has no
    such member: :func:`inject_token_ids` of a body without one)."""
    i = raw.find(b"{") + 1
    j = i
    n = len(raw)
    while j < n and raw[j] in _SPACES:      # no copy of the body to look past the spaces
        j += 1
    return b"".join((raw[:i], _WITH_IDS_LAST if j < n and raw[j] == 0x7D else _WITH_IDS,
                     raw[i:]))


_SPACES = frozenset(b" \t\n\r\x0b\x0c")      # bytes.strip's
_WITH_IDS = b'"return_token_ids":true,'
_WITH_IDS_LAST = b'"return_token_ids":true'       # in an empty object


class StreamRecovery:
    """The state of one recoverable stream across its legs (see the module docstring).

    Feed the engine's complete SSE events of each leg to :meth:`feed`; it returns the
    bytes for the client. After a leg ends, :meth:`leg_end` says how it ended (and so whether
    the request must go on elsewhere), and :meth:`continuation` builds that request.
    ``scan``: read the first leg on the bytes (:class:`~motor._fast.sse.EventScanner`);
    ``False`` runs every event through the JSON path (the reference the tests compare with).

    ``body`` ``None``: the request was scanned, not parsed
    (:func:`motor._fast.reqscan.scan_request`, ``plain``): it has none of the members read
    here but the length bound, whose value is ``bound`` (an integer or ``None``), and
    :attr:`body` is ``parsed.body`` (parsed on first use: only a continuation needs it).
    """

    __slots__ = ("chat", "_body", "_parsed", "client_ids", "prompt_ids", "gen", "leg",
                 "leg_is_cmpl", "leg_base", "finished", "done", "recomputed", "engine_error",
                 "ids_missing", "blocked", "role_sent", "resp_id", "created", "model",
                 "include_usage", "engine_error_status", "usage_sent", "max_tokens",
                 "min_tokens", "finish_reason", "scanner")

    def __init__(self, chat: bool, body: dict[str, Any] | None, scan: bool = True, *,
                 parsed: Any = None, bound: int | None = None) -> None:
        self.chat = chat
        self._body = body
        self._parsed = parsed
        self.client_ids = body is not None and body.get("return_token_ids") is True
        self.prompt_ids: list[int] | None = None
        self.gen: list[int] = []
        self.leg = 0
        self.leg_is_cmpl = not chat    # shape of the current leg's chunks
        self.leg_base = 0              # generated tokens before the current leg
        self.finished = False          # a finishing chunk reached the client
        self.finish_reason: str | None = None
        self.done = False              # [DONE] reached the client
        self.recomputed = False        # the current leg ended with stop_reason "recomputed"
        self.engine_error: bytes | None = None  # the current leg sent an error event
        self.engine_error_status: int | None = None   # its ``code``, when an HTTP status
        self.ids_missing = False
        self.blocked: str | None = None
        self.role_sent = False
        self.resp_id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.usage_sent = False
        if body is not None:
            so = body.get("stream_options")
            self.include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
            mt = max_tokens_field(body, chat)
            mn = body.get("min_tokens")
            self.min_tokens = mn if isinstance(mn, int) else 0
        else:
            self.include_usage = False
            mt = bound
            self.min_tokens = 0
        # completions: absent or null = vLLM's default 16 (vLLM 0.32 reads an explicit null
        # like an absent max_tokens, measured on the CPU build); chat: no bound = the context
        if mt is None and not chat:
            mt = COMPLETIONS_DEFAULT_MAX_TOKENS
        self.max_tokens: int | None = mt
        #: the first leg's byte scanner (None: JSON path only)
        self.scanner: EventScanner | None = EventScanner(chat, self.client_ids) if scan else None

    @property
    def body(self) -> dict[str, Any]:
        """The request's JSON body (``parsed.body`` on first use when made from a scan)."""
        b = self._body
        if b is None:
            b = self._body = self._parsed.body
        return b

    # -- a leg's events ---------------------------------------------------------------
    def feed(self, block: bytes) -> bytes:
        """``block``: one or more complete SSE events (each ends with a blank line)."""
        sc = self.scanner
        if sc is None or self.leg or self.recomputed or self.engine_error is not None:
            return self._feed_json(block)
        out = sc.feed(block, self.gen)
        if out is None:                 # not understood: the JSON path, then its state back
            return self.unscanned(block)
        if sc.news:
            self.took(sc)
        return out

    def scanning(self) -> tuple[EventScanner, list[int]] | None:
        """``(scanner, gen)`` while :meth:`feed` hands blocks to the byte scanner (the first
        leg; nothing the JSON path must rewrite), else ``None``.

        A compiled relay may then do :meth:`feed`'s work itself, block by block, without a
        Python call per block: ``out = scanner.feed(block, gen)``; when ``out`` is
        ``None``, ``out = self.unscanned(block)`` and every later block goes to
        :meth:`feed` (which decides again); otherwise, when ``scanner.news``,
        :meth:`took` ``(scanner)``."""
        sc = self.scanner
        if sc is None or self.leg or self.recomputed or self.engine_error is not None:
            return None
        return sc, self.gen

    def unscanned(self, block: bytes) -> bytes:
        """A block the scanner gave back (``None``: not understood, nothing recorded)
        through the JSON path; the state it leaves copied into the scanner."""
        out = self._feed_json(block)
        sc = self.scanner
        assert sc is not None
        sc.sync(role_sent=self.role_sent, ids_missing=self.ids_missing,
                blocked=self.blocked is not None, finished=self.finished,
                have_id=self.resp_id is not None, have_prompt=self.prompt_ids is not None,
                usage_sent=self.usage_sent, done=self.done)
        return out

    def took(self, sc: EventScanner) -> None:
        """The stream state the scanner's last block changed (``sc.news``)."""
        self.role_sent = sc.role_sent
        self.ids_missing = sc.ids_missing
        if sc.blocked and self.blocked is None:
            self.blocked = "reasoning or tool-call output"
        self.finished = sc.finished
        if sc.finish_reason is not None:
            self.finish_reason = sc.finish_reason
        if sc.captured and self.resp_id is None:
            self.resp_id, self.created, self.model = sc.resp_id, sc.created, sc.model
        if sc.prompt_ids is not None and self.prompt_ids is None:
            self.prompt_ids = sc.prompt_ids
        self.usage_sent = sc.usage_sent
        self.done = sc.done

    def _feed_json(self, block: bytes) -> bytes:
        """:meth:`feed` through ``orjson`` (every event decoded, edited, re-encoded)."""
        out: list[bytes] = []
        for ev in block.split(b"\n\n"):
            if not ev:
                continue
            if b"\n" not in ev:
                b = self._line(ev)
                if b is not None:
                    out.append(b + b"\n\n")
                continue
            # several lines in one event (e.g. a usage line and [DONE] with a single newline
            # between them, case B04 b): each data line is read on its own, the bytes kept
            lines = [b for b in (self._line(x) for x in ev.split(b"\n")) if b is not None]
            if lines:
                out.append(b"\n".join(lines) + b"\n\n")
        return b"".join(out)

    def _line(self, ev: bytes) -> bytes | None:
        if not ev.startswith(b"data:"):
            return ev                      # comments, other fields: pass
        payload = ev[5:].strip()
        if payload == _DONE:
            if self.recomputed or self.engine_error is not None:
                return None                # the stream goes on elsewhere
            if not self.finished:
                # an engine that ends without a finishing chunk: treat as broken
                self.engine_error = b"[DONE] before a finishing chunk"
                return None
            self.done = True
            if self.include_usage and not self.usage_sent and self.leg > 0:
                return self._synth_usage() + b"data: [DONE]"
            return ev
        try:
            obj = _loads(payload)
        except orjson.JSONDecodeError:
            return ev
        return self._event(obj, ev)

    def _event(self, obj: Any, raw: bytes) -> bytes | None:
        """One decoded ``data:`` event of the current leg -> the bytes for the client
        (``None``: drop it); records token ids and how the leg ends."""
        if not isinstance(obj, dict):
            return raw
        if "error" in obj and "choices" not in obj:
            self.engine_error = raw
            self.engine_error_status = _error_status(obj["error"])
            return None
        first_leg = self.leg == 0
        if first_leg and self.resp_id is None:
            self.resp_id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
        # vLLM's first chat chunk carries the prompt ids (one membership test per event)
        changed = "prompt_token_ids" in obj and self._chat_prompt_ids(obj)
        usage = obj.get("usage")
        choices = obj.get("choices")
        if not choices:
            return self._usage_event(obj, raw, usage, first_leg, changed)
        c = choices[0]
        tids = c.get("token_ids")
        if "token_ids" in c:
            if tids:
                self.gen.extend(tids)
            if not self.client_ids:
                del c["token_ids"]
                changed = True
        if self.leg_is_cmpl:
            text = c.get("text") or ""
            if "prompt_token_ids" in c:
                changed = self._cmpl_prompt_ids(c, first_leg) or changed
        else:
            delta = c.get("delta") or {}
            text = delta.get("content") or ""
            if "role" in delta:
                if self.role_sent:
                    del delta["role"]
                    changed = True
                    if not text and c.get("finish_reason") is None and tids is None:
                        return None         # a restarted leg's role chunk: already sent
                self.role_sent = True
            if self.blocked is None and ("reasoning_content" in delta or "tool_calls" in delta
                                         or "reasoning" in delta):
                self.blocked = "reasoning or tool-call output"
        if tids is None and text:
            self.ids_missing = True
        fr = c.get("finish_reason")
        if c.get("stop_reason") == "recomputed":
            self.recomputed = True
            c["finish_reason"] = None
            c.pop("stop_reason", None)
            changed = True
            if not text and not tids:
                return None
        elif fr is not None:
            self.finished = True
            self.finish_reason = fr
        if usage is not None and not first_leg:
            obj["usage"] = self._fix_usage(usage)
            changed = True
        if self.chat and self.leg_is_cmpl:
            return self._as_chat(obj, c, text, usage)
        if not first_leg:
            self._stamp(obj)
            changed = True
        return self._out(obj, raw, changed)

    def _chat_prompt_ids(self, obj: dict[str, Any]) -> bool:
        """A chat leg's top-level ``prompt_token_ids`` (vLLM's first chunk): recorded, and
        removed unless the client asked for them; whether ``obj`` changed."""
        if not self.chat or self.leg_is_cmpl:
            return False
        pids = obj.get("prompt_token_ids")
        if pids is None:
            return False
        if self.prompt_ids is None:
            self.prompt_ids = pids
        if not self.client_ids or self.role_sent:
            del obj["prompt_token_ids"]
            obj.pop("prompt_text", None)   # vLLM adds it with return_token_ids
            return True
        return False

    def _cmpl_prompt_ids(self, c: dict[str, Any], first_leg: bool) -> bool:
        """A completion choice's ``prompt_token_ids`` / ``prompt_text``: recorded, passed on
        only in the first leg to a client that asked for them; whether ``c`` changed."""
        pids = c.pop("prompt_token_ids", None)
        if pids is None:
            return False
        ptext = c.pop("prompt_text", None)
        if first_leg and self.client_ids and ptext is not None:
            c["prompt_text"] = ptext
        if self.prompt_ids is None:
            self.prompt_ids = pids
        if first_leg and self.client_ids:
            c["prompt_token_ids"] = pids
        return True

    def _usage_event(self, obj: dict[str, Any], raw: bytes, usage: Any, first_leg: bool,
                     changed: bool) -> bytes | None:
        """An event without choices (the usage chunk, or something else passed on)."""
        if usage is not None and self.recomputed:
            return None                 # the recomputed leg's usage: the next leg counts
        if usage is not None:
            if not first_leg:
                obj["usage"] = self._fix_usage(usage)
                self._stamp(obj)
                if self.chat:
                    obj["object"] = "chat.completion.chunk"
                changed = True
            self.usage_sent = True
        return self._out(obj, raw, changed)

    def _out(self, obj: dict[str, Any], raw: bytes, changed: bool) -> bytes:
        if not changed:
            return raw
        return b"data: " + _dumps(obj)

    def _stamp(self, obj: dict[str, Any]) -> None:
        if self.resp_id is not None:
            obj["id"] = self.resp_id
        if self.created is not None:
            obj["created"] = self.created
        if self.model is not None:
            obj["model"] = self.model

    def _as_chat(self, obj: dict[str, Any], c: dict[str, Any], text: str, usage: Any) -> bytes:
        """A completion chunk of a chat's continuation, reshaped as a chat chunk."""
        delta: dict[str, Any] = {"content": text}
        if not self.role_sent:
            delta = {"role": "assistant", "content": text}
            self.role_sent = True
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": c.get("finish_reason")}
        if c.get("finish_reason") is not None:
            choice["stop_reason"] = c.get("stop_reason")
        if self.client_ids and "token_ids" in c:
            choice["token_ids"] = c["token_ids"]
        out: dict[str, Any] = {"id": self.resp_id, "object": "chat.completion.chunk",
                               "created": self.created, "model": self.model, "choices": [choice]}
        if usage is not None:
            out["usage"] = obj["usage"]
        return b"data: " + _dumps(out)

    def _usage_numbers(self) -> tuple[int, int]:
        return len(self.prompt_ids or ()), len(self.gen)

    def _fix_usage(self, usage: Any) -> Any:
        if not isinstance(usage, dict):
            return usage
        u = dict(usage)
        p = len(self.prompt_ids) if self.prompt_ids is not None else u.get("prompt_tokens", 0)
        c = self.leg_base + (u.get("completion_tokens") or 0)
        u["prompt_tokens"] = p
        u["completion_tokens"] = c
        u["total_tokens"] = p + c
        d = u.get("prompt_tokens_details")
        if isinstance(d, dict) and isinstance(d.get("cached_tokens"), int):
            u["prompt_tokens_details"] = dict(d, cached_tokens=min(d["cached_tokens"], p))
        return u

    def _synth_usage(self) -> bytes:
        p, c = self._usage_numbers()
        self.usage_sent = True
        obj = {"id": self.resp_id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "choices": [], "usage": {"prompt_tokens": p, "total_tokens": p + c,
                                        "completion_tokens": c}}
        return b"data: " + _dumps(obj) + b"\n\n"

    # -- between legs -----------------------------------------------------------------
    def leg_end(self) -> str:
        """How the current leg ended, once its events are fed: ``done`` (``[DONE]`` reached
        the client), ``finished`` (the finishing chunk did, ``[DONE]`` did not: end it with
        :meth:`tail_after_finish`), ``recomputed`` (preempted: continue), ``engine_error``
        (an error event instead of chunks: continue) or ``broken`` (cut off: continue)."""
        if self.done:
            return "done"
        if self.recomputed:
            return "recomputed"
        if self.finished:
            return "finished"
        if self.engine_error is not None:
            return "engine_error"
        return "broken"

    def tail_after_finish(self) -> bytes:
        """The end of a stream whose engine failed after the finishing chunk."""
        out = b""
        if self.include_usage and not self.usage_sent and not self.ids_missing:
            out = self._synth_usage()
        self.done = True
        return out + b"data: [DONE]\n\n"

    def remaining(self) -> int | None:
        if self.max_tokens is None:
            return None
        return self.max_tokens - len(self.gen)

    def why_not(self) -> str | None:
        """Why the stream cannot be continued now (``None``: it can)."""
        if self.blocked:
            return self.blocked
        if self.ids_missing:
            return "the engine did not return token ids"
        if self.prompt_ids is None and self.gen:
            return "the engine did not return the prompt's token ids"
        return None

    def continuation(self, path: bytes, max_model_len: int | None = None
                     ) -> tuple[bytes, bytes]:
        """(path, body) of the next leg; starts the leg's bookkeeping.

        Before any token id is known (the engine died before its first chunk) the next
        leg is the original request again on ``path``. ``max_model_len``: the engines'
        context length (their ``/v1/models``), for a request without a length bound: the
        continuation then asks for what is left of the context (else ``max_tokens: null``).
        """
        self.recomputed = False
        self.engine_error = None
        self.engine_error_status = None
        self.leg += 1
        self.leg_base = len(self.gen)
        if self.prompt_ids is None:
            self.leg_is_cmpl = not self.chat
            return path, inject_token_ids(_dumps(self.body), self.body)
        b = {k: v for k, v in self.body.items() if not (self.chat and k in _CHAT_ONLY)}
        b["prompt"] = self.prompt_ids + self.gen
        b.pop("max_completion_tokens", None)
        # what the request had left; no limit stays no limit (case N05): /v1/completions
        # without max_tokens stops at vLLM's 16 (and vLLM 0.32 reads null the same way), so
        # the rest of the context when the engines' length is known, else an explicit null
        rem = self.remaining()
        if rem is None and max_model_len is not None:
            rem = max(1, max_model_len - len(b["prompt"]))
        b["max_tokens"] = rem
        if self.min_tokens:
            b["min_tokens"] = max(0, self.min_tokens - len(self.gen))
        b["return_token_ids"] = True
        b["stream"] = True
        self.leg_is_cmpl = True
        return b"/v1/completions", _dumps(b)

    def length_tail(self) -> bytes:
        """Every token of ``max_tokens`` was sent but no finishing chunk: finish it here."""
        self.finished = True
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}
            obj = {"id": self.resp_id, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.model, "choices": [choice]}
        else:
            obj = {"id": self.resp_id, "object": "text_completion", "created": self.created,
                   "model": self.model, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                     "finish_reason": "length",
                                                     "stop_reason": None}]}
        return b"data: " + _dumps(obj) + b"\n\n" + self.tail_after_finish()


# -- the failover decision (union and PD streams) -----------------------------------------
END, REFUSE, CONTINUE = "end", "refuse", "continue"


class Verdict:
    """What to do once a stream's leg ended (:func:`after_leg`).

    ``action``: :data:`END` (write ``tail``, end the answer: status 200), :data:`REFUSE`
    (end with one error event, 502: ``tail`` is the engine's own error event + ``[DONE]``
    when it sent one, else ``None`` and the caller writes one from ``why``) or
    :data:`CONTINUE` (send ``body`` to ``path`` on another instance). ``reason``: how the
    leg ended (the ``failovers_total`` label on CONTINUE: broken, engine_error, recomputed,
    restart). ``engine_ok``: whether the leg counts for its endpoint's breaker (a
    ``recomputed`` preemption, a client error, or a finished stream whose transport was
    fine). ``status``: what a REFUSE counts as (the in-band error's 4xx, else 502)."""

    __slots__ = ("action", "reason", "engine_ok", "tail", "why", "path", "body", "status")

    def __init__(self, action: str, reason: str, engine_ok: bool, tail: bytes | None = b"",
                 why: str | None = None, path: bytes = b"", body: bytes = b"",
                 status: int = 502) -> None:
        self.action = action
        self.reason = reason
        self.engine_ok = engine_ok
        self.tail = tail
        self.why = why
        self.path = path
        self.body = body
        self.status = status


def after_leg(rec: StreamRecovery | None, err: BaseException | None, *, legs: int,
              max_continuations: int, wrote_any: bool, path: bytes, raw: bytes = b"",
              why_not: str = "",
              max_model_len: Callable[[], int | None] | None = None) -> Verdict:
    """The one failover decision, once a leg's events are relayed.

    ``rec``: the stream's recovery state (``None``: not continuable, ``why_not`` says
    why); ``err``: the transport error that ended the leg (an idle timeout is the caller's:
    it ends the stream with 504 before asking); ``legs``: continuations so far;
    ``wrote_any``: whether an event reached the client; ``path`` / ``raw``: the request to
    send again when a stream without recovery broke before its first event;
    ``max_model_len``: returns the engines' context length when known (a continuation of a
    request without a length bound asks for the rest of it); called only to build a
    continuation (a lookup over the endpoints, not made for every stream that ends).

    A stream without recovery ends when its engine ended it, is restarted whole while
    nothing reached the client, else refused. A recoverable one ends at ``[DONE]`` or after
    its finishing chunk (:meth:`StreamRecovery.tail_after_finish`), ends with a ``length``
    finish when ``max_tokens`` were all sent, else continues
    (:meth:`StreamRecovery.continuation`) unless :meth:`StreamRecovery.why_not` or
    ``max_continuations`` refuses.
    """
    if rec is None:
        if err is None:
            return Verdict(END, "done", True)
        reason = "broken"
    else:
        reason = rec.leg_end()
        if reason == "done":
            return Verdict(END, reason, err is None)
        if reason == "finished":
            return Verdict(END, reason, err is None, rec.tail_after_finish())
    own = rec.engine_error if rec is not None else None
    st = rec.engine_error_status if rec is not None else None
    if reason == "engine_error" and own is not None and st is not None and 400 <= st < 500 \
            and not (st == 429 and not wrote_any):      # 429 before any content: elsewhere
        # the engine refused the request itself (an oversize prompt...): another engine would
        # too, and it says nothing of this one's health (case N04): passed on, not retried
        return Verdict(REFUSE, reason, True, own + b"\n\n" + SSE_DONE,
                       f"the engine refused the request ({st})", status=st)
    engine_ok = reason == "recomputed"
    why: str | None
    if legs >= max_continuations:
        why = f"{legs} continuation(s) already"
    elif rec is not None:
        why = rec.why_not()
    elif wrote_any:
        why = f"the request cannot be continued exactly ({why_not})"
    else:
        why = None
    if why is not None:
        # the engine's error event (one line, kept without its blank line), then [DONE]
        tail = own + b"\n\n" + SSE_DONE if own is not None and own.startswith(b"data:") \
            else None
        return Verdict(REFUSE, reason, engine_ok, tail, why)
    if rec is None:
        return Verdict(CONTINUE, "restart", engine_ok, path=path, body=raw)
    rem = rec.remaining()
    if rem is not None and rem <= 0:
        return Verdict(END, reason, engine_ok, rec.length_tail())
    path, body = rec.continuation(path, None if max_model_len is None else max_model_len())
    if not wrote_any and reason == "broken":
        reason = "restart"
    return Verdict(CONTINUE, reason, engine_ok, path=path, body=body)
