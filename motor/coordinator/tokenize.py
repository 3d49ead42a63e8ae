"""Token ids of a request, as the engine computes them, for the routing key.

The prefix index matches block hashes of token ids (:mod:`motor._fast.hashing`), and
the engines report the token ids they cached, so the coordinator must tokenize a
request exactly as the engine does:

* ``/v1/chat/completions``: the model's chat template (jinja2, in a sandbox, as vLLM
  and HF ``apply_chat_template`` do) renders the whole conversation with
  ``messages``, ``add_generation_prompt`` (default true), ``continue_final_message``,
  ``tools``, ``documents`` and ``chat_template_kwargs``; the text is encoded without
  adding special tokens (vLLM's chat default). The routing key is the whole templated
  conversation, not its first message.
* ``/v1/completions``: ``prompt`` as text (encoded with the tokenizer's special
  tokens, ``add_special_tokens=True`` as vLLM), as token ids (used as sent), or a
  list of either (the first prompt is the key).

Tokenizers come from a model directory (``tokenizer.json`` + ``tokenizer_config.json``
with ``chat_template``; HF layout) given per model in ``coordinator.kv.tokenizers``.
``motor sim`` writes its byte-level tokenizer directory to
``~/.cache/motor/sim-tokenizer`` by default (``motor sim --model-dir``); a real
vLLM engine serving a model made from that directory computes the same ids.
``builtin`` is the same byte-level tokenizer and ChatML template computed in Python
without any file (:mod:`motor.protocol.chat_tokenizer`: token id = UTF-8 byte value;
``<|endoftext|>`` 256, ``<|im_start|>`` 257, ``<|im_end|>`` 258).

Cost on the request path (:class:`Tokenizers`): a chat's text is cut at the tokenizer's
added tokens and each piece's ids are kept in an LRU (:meth:`RoutingTokenizer.encode_chat`):
a system prompt or earlier turns seen before are not encoded again, and the hash chain's
state after them is kept too (:meth:`RoutingTokenizer.plan_key`): only the new turn is
assembled and hashed, and a chat seen whole before (a retry, a PD fallback, a repeated
prompt) is one lookup there from its third time on. Such a chat has no key of its own: the
JSON of its messages and its lookup cost more than its pieces' lookups, and a workload of
new user turns never meets it again. The routing key (token count and block hashes,
:meth:`Tokenizers.block_key`) of every other request (a completion's text prompt, a chat of
a tokenizer that encodes it whole) is kept in an LRU keyed by exactly what it depends on
(the tokenizer, and the chat's ``messages`` with the template's other inputs, or the
completion's text), bounded in entries and in bytes; :meth:`Tokenizers.token_ids` keeps the
ids of every request alike, in its own LRU. With a byte-level BPE (GPT-2's pre-tokenizer), a
new ASCII piece is cut into its words (compiled: :func:`motor._fast.pretok.encode_ascii_words`)
and only words not seen before go to the BPE model (:meth:`RoutingTokenizer.encode_piece`:
the library's pre-tokenizer regex costs more than the rest of its encode). Text not cached
of at least :data:`OFF_LOOP_MIN_CHARS` characters is encoded in a bounded thread pool
(``tokenizers`` releases the GIL while it encodes) while the event loop goes on
(:meth:`Tokenizers.warm`); shorter text inline, where a thread hop would cost more than the
encode.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import orjson

from motor._fast.chatplan import assemble as _assemble
from motor._fast.chatplan import plan_cut
from motor._fast.hashing import block_hashes, extend_hashes
from motor._fast.bpe import ByteLevelBpe
from motor._fast.pretok import ByteLevelMiss, WordIds, encode_ascii_words, split_added
from motor.config.schema import CoordinatorConfig, DeploymentMode, PolicyName
from motor.errors import ConfigError
from motor.protocol import chat_tokenizer

if TYPE_CHECKING:
    from motor.coordinator.chat_splice import SpliceCache

logger = logging.getLogger(__name__)

BUILTIN = "builtin"

#: token-id cache bounds: requests kept, and token ids held in all (a list slot and an int
#: each, ~36 bytes a token: 2^19 tokens are ~18 MiB)
CACHE_MAX_ENTRIES = 4096
CACHE_MAX_TOKENS = 1 << 19
#: routing keys (block hashes) kept: requests (:attr:`Tokenizers.keys`) and chat prefixes
#: per tokenizer (:attr:`RoutingTokenizer.prefixes`)
KEYS_MAX_ENTRIES = 4096
PREFIXES_MAX_ENTRIES = 1024
#: and in size: the request keys' bytes (JSON of the messages) with 8 bytes a block hash,
#: and the prefixes' characters (the newest entry is always kept)
KEYS_MAX_BYTES = 1 << 25
PREFIXES_MAX_CHARS = 1 << 22
#: words whose ids are kept per generation (:class:`WordCache`; ~150 bytes a word)
WORDS_MAX = 1 << 15
#: slots of the table of recent words in front of it (:class:`motor._fast.pretok.WordIds`)
WORDS_RECENT = 1 << 12
#: texts at least this long (characters) are encoded in the thread pool (about 4 KiB of
#: prompt, ~1k tokens: a few hundred microseconds of encode against ~50 us of thread hop)
OFF_LOOP_MIN_CHARS = 4096
#: threads of the encode pool (per coordinator worker)
OFF_LOOP_THREADS = 2


#: the largest token id a routing key holds (ids are hashed as uint32, as the engines'
#: block hashes take them)
_MAX_TOKEN_ID = 0xFFFFFFFF


class TokenizeError(ValueError):
    """The request cannot be tokenized (bad messages, template error)."""


def _content_text(content: Any) -> str:
    try:
        return chat_tokenizer.content_text(content)
    except ValueError as e:
        raise TokenizeError(str(e)) from None


class RoutingTokenizer:
    """Encodes requests for one model.

    Parameters
    ----------
    source : str
        ``builtin``, or a model directory path (``~`` expanded) holding
        ``tokenizer.json`` and ``tokenizer_config.json``.

    Raises
    ------
    ValueError
        when the directory or its files are missing, unreadable or malformed, or its chat
        template is not valid jinja2.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._tok: Any = None
        self._template: Any = None
        self._splice: SpliceCache | None = None
        self._bos: str | None = None
        self._eos: str | None = None
        #: added tokens' split of a chat's text (:func:`piece_splitter`, its pattern in a
        #: capture group), None: encoded whole
        self._split: tuple[re.Pattern[str], dict[str, int]] | None = None
        #: the same split compiled (:func:`motor._fast.pretok.split_added`): the tokens'
        #: common prefix, the tokens longest first (the pattern's order), token -> id
        self._split_fast: tuple[str, tuple[str, ...], dict[str, int]] = ("", (), {})
        #: whether a spliced chat's plan may come from its segments' own splits
        #: (:func:`_splice_plans_exact`; :meth:`plan_chat`)
        self._splice_plans = False
        #: token ids of the pieces between added tokens (chat texts, see chat_ids)
        self.pieces = TokenCache()
        #: pre-token split of a piece, when its ids are those of its words encoded alone
        #: (:func:`word_splitter`): ASCII pieces are encoded word by word from :attr:`words`
        self._words_re: re.Pattern[str] | None = None
        self._model: Any = None
        #: token ids of words (pre-tokens) seen in chat pieces, see :meth:`encode_piece`,
        #: and the recent ones in a table in front of it (no str nor dict look-up a word)
        self.words = WordCache()
        #: a word not in :attr:`words`' current generation: from the old one, else the BPE
        #: model on its bytes in the byte-level alphabet (:class:`~motor._fast.pretok.ByteLevelMiss`
        #: compiled; made on first use)
        self._word_miss: ByteLevelMiss | None = None
        #: the BPE model's merges compiled, for those words (:func:`compiled_bpe`; None:
        #: the library's model encodes them)
        self._bpe: ByteLevelBpe | None = None
        self.recent_words = WordIds(WORDS_RECENT)
        #: hash-chain state after a chat's leading plan elements: (block size, salt,
        #: *elements) -> (tokens, hashes of their full blocks, ids of the partial block);
        #: see :meth:`plan_key`
        self.prefixes: OrderedDict[tuple[object, ...], tuple[int, npt.NDArray[np.uint64],
                                                             list[int], int]] = OrderedDict()
        #: characters of the text pieces held by :attr:`prefixes`' keys
        self.prefix_chars = 0
        #: the splice cache's callbacks, bound once (not a bound method made a request)
        self._render_bound = self._render_messages
        self._split_bound = self._split_segment
        if source == BUILTIN:
            return
        d = Path(source).expanduser()
        try:
            self._load_files(d)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a malformed config or template: one error
            raise ValueError(f"tokenizer directory {str(d)!r}: tokenizer_config.json or its "
                             f"chat template is not what a model directory holds: "
                             f"{type(e).__name__}: {e}") from None

    def _load_files(self, d: Path) -> None:
        """Read the model directory ``d`` (:class:`RoutingTokenizer`'s ``source``); raises
        ``ValueError`` for a missing or unreadable file or a template that is not jinja2,
        and whatever a malformed file makes the steps after raise."""
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        from motor.coordinator.chat_splice import SpliceCache, splice_safe

        try:
            self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
            with open(d / "tokenizer_config.json", encoding="utf-8") as f:
                cfg = json.load(f)
            with open(d / "tokenizer.json", encoding="utf-8") as f:
                tj = json.load(f)
            sp = piece_splitter(tj)
            self._split = None if sp is None else (_capturing(sp[1]), sp[1])
            if sp is not None:
                names = tuple(sorted(sp[1], key=len, reverse=True))
                pre = os.path.commonprefix(names)
                self._split_fast = (pre, names, sp[1])
                self._splice_plans = _splice_plans_exact(pre, names)
            self._words_re = word_splitter(tj)
            self._model = self._tok.model
            if self._words_re is not None:
                self._bpe = compiled_bpe(tj)
        except Exception as e:  # noqa: BLE001 - file missing / malformed: one clear error
            raise ValueError(f"tokenizer directory {str(d)!r} is expected to hold tokenizer.json "
                             f"and tokenizer_config.json: {e}") from None
        if self._split is not None and getattr(self._tok, "encode_special_tokens", False):
            self._split = None
        if self._split is None:
            self._words_re = None

        def token_text(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        self._bos = token_text(cfg.get("bos_token"))
        self._eos = token_text(cfg.get("eos_token"))
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # named templates: take "default"
            tmpl = next((t.get("template") for t in tmpl if t.get("name") == "default"), None)
        if tmpl is None and (d / "chat_template.jinja").exists():
            tmpl = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if tmpl is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])

            def raise_exception(message: str) -> None:
                raise TokenizeError(message)

            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: \
                json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
            try:
                self._template = env.from_string(tmpl)
                parsed = env.parse(tmpl)
            except TemplateSyntaxError as e:
                raise ValueError(f"tokenizer directory {str(d)!r}: its chat template is "
                                 f"expected to be a valid jinja2 template, got an error at "
                                 f"line {e.lineno}: {e.message}") from None
            #: renders by message structure with the contents spliced in, when the
            #: template only outputs contents (:mod:`motor.coordinator.chat_splice`)
            self._splice = SpliceCache() if splice_safe(parsed) else None
            # the template's globals are a ChainMap over the environment's (jinja2 3.x); every
            # render copies them into its context (dict() and set() of the ChainMap: half of
            # a short chat's render). Nothing changes them after this: one flat dict.
            self._template.globals = dict(self._template.globals)

    # -- text -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (special-token strings become their ids)."""
        if self._tok is None:
            return chat_tokenizer.encode(text)
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    # -- chat -----------------------------------------------------------------
    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text the engine builds from a chat request body."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise TokenizeError("messages is expected to be a list of objects")
        for m in messages:      # (a loop: all() over a generator costs more)
            if not isinstance(m, dict):
                raise TokenizeError("messages is expected to be a list of objects")
        cont = bool(body.get("continue_final_message", False))
        if self._template is None:
            if self._tok is not None:
                raise TokenizeError(f"tokenizer {self.source!r} has no chat_template")
            try:
                return chat_tokenizer.render_chat(
                    messages, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                    continue_final_message=cont)
            except ValueError as e:
                raise TokenizeError(str(e)) from None
        sp = self._splice
        flags = None if sp is None else self._splice_flags(body, cont)
        spliced = None if flags is None or sp is None else \
            sp.render(messages, flags, self._render_messages)
        try:
            if spliced is not None:
                text = spliced
            else:
                # the template's other inputs (what _splice_flags finds none of to splice)
                kwargs: dict[str, Any] = {}
                extra = body.get("chat_template_kwargs")
                if isinstance(extra, dict):
                    kwargs.update(extra)
                for k in ("tools", "documents"):
                    if body.get(k) is not None:
                        kwargs[k] = body[k]
                text = self._template.render(
                    messages=messages,
                    add_generation_prompt=bool(body.get("add_generation_prompt", True))
                    and not cont, bos_token=self._bos or "", eos_token=self._eos or "",
                    **kwargs)
        except TokenizeError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise TokenizeError(f"chat template failed: {type(e).__name__}: {e}") from None
        if cont and messages:
            # vLLM / HF: cut the rendered text right after the final message's content
            last = _content_text(messages[-1].get("content"))
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[: cut + len(last)]
        return text

    def _splice_flags(self, body: dict[str, Any], cont: bool) -> bool | None:
        """When the splice cache may render a chat body (:meth:`render_chat`,
        :meth:`plan_chat`: the one rule of both): the flag it renders the template with
        and keys the message structure on (``add_generation_prompt``, false where
        ``continue_final_message`` is: ``cont``, as the caller read it), or ``None`` when
        the template gets other inputs (``tools``, ``documents``, a non-empty dict of
        ``chat_template_kwargs``; one that is not a dict is ignored, as by the whole
        render): then the chat is rendered whole."""
        if body.get("tools") is not None or body.get("documents") is not None:
            return None
        extra = body.get("chat_template_kwargs")
        if extra is not None and isinstance(extra, dict) and extra:
            return None
        return not cont and bool(body.get("add_generation_prompt", True))

    def plan_chat(self, body: dict[str, Any]) -> tuple[str | None, list[str | int] | None]:
        """(text, plan) of a chat body: :meth:`render_chat` and :meth:`chat_plan`, or, for a
        chat the splice cache renders (:mod:`motor.coordinator.chat_splice`;
        :meth:`_splice_flags`), not continued (``continue_final_message``: its text is cut
        after the final content), and whose contents hold none of the added tokens' common
        prefix, the plan alone (text ``None``) from the structure's segments split once
        (:meth:`~motor.coordinator.chat_splice.SpliceCache.plan`): neither the text nor
        its scan is made.

        Raises
        ------
        TokenizeError
            as :meth:`render_chat`.
        """
        sp = self._splice
        if sp is not None and self._splice_plans:
            messages = body.get("messages")
            if type(messages) is list and not body.get("continue_final_message"):
                flags = self._splice_flags(body, False)
                if flags is not None:
                    plan = sp.plan(messages, flags, self._render_bound,
                                   self._split_bound, self._split_fast[0])
                    if plan is not None:
                        return None, plan
        text = self.render_chat(body)
        return text, self.chat_plan(text)

    def _split_segment(self, text: str) -> list[str | int]:
        pre, names, ids = self._split_fast
        return split_added(text, pre, names, ids)

    def _render_messages(self, messages: list[dict[str, Any]], add_generation_prompt: object
                         ) -> str:
        """The template's text for ``messages`` without extra inputs (the splice cache's
        render of a new message structure)."""
        text: str = self._template.render(messages=messages,
                                          add_generation_prompt=add_generation_prompt,
                                          bos_token=self._bos or "", eos_token=self._eos or "")
        return text

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """Token ids of a chat body (:meth:`plan_chat`, then its pieces' ids)."""
        text, plan = self.plan_chat(body)
        if plan is not None:
            return self.assemble(plan)
        assert text is not None
        return self.encode_chat(text)

    def chat_plan(self, text: str) -> list[str | int] | None:
        """A chat text cut at its added tokens: text pieces and added-token ids, in order
        (``None``: this tokenizer encodes it whole, see :func:`piece_splitter`)."""
        sp = self._split
        if sp is None:
            return None
        pre, names, ids = self._split_fast
        if pre:     # the tokens share a prefix (ChatML's "<|"): compiled, the same pieces
            return split_added(text, pre, names, ids)
        # the split's capture group keeps the added tokens: text, token, text, ..., text
        parts = sp[0].split(text)
        added = sp[1]
        return [added[p] if i & 1 else p for i, p in enumerate(parts) if p]

    def encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """Token ids of each text piece (no cache: safe in a thread)."""
        return [self._tok.encode(p, add_special_tokens=False).ids for p in pieces]

    def encode_piece(self, piece: str) -> list[int]:
        """Token ids of one text piece of a chat (between added tokens), on the event loop.

        With a :func:`word_splitter` and an ASCII piece, the piece is cut into its
        pre-tokens (words: :func:`motor._fast.pretok.encode_ascii_words`, the split of
        :data:`_BYTE_LEVEL_ASCII` compiled) and each word's ids come from :attr:`words`; only
        the words not seen before are encoded: the BPE model alone on the word's bytes in the
        byte-level alphabet, which is what the ``tokenizers`` pipeline of such a tokenizer does with
        each pre-token (no normalizer; the model sees one pre-token at a time), so the ids
        are the piece's. Other pieces are encoded whole."""
        if self._words_re is None or not piece.isascii():
            ids: list[int] = self._tok.encode(piece, add_special_tokens=False).ids
            return ids
        miss = self._word_miss
        if miss is None:
            miss = self._word_miss = ByteLevelMiss(self.words, self._model, self._bpe)
        return encode_ascii_words(piece, self.words, miss, self.recent_words)

    def encode_chat(self, text: str, plan: list[str | int] | None = None) -> list[int]:
        """Token ids of a rendered chat (no special tokens added, as vLLM's chat);
        ``plan``: its :meth:`chat_plan` when the caller has it already.

        With a :func:`piece_splitter`, the pieces between added tokens are encoded on their
        own and kept in :attr:`pieces` (LRU): a system prompt or earlier turns seen before
        cost a lookup. That is what ``tokenizers`` itself does (added tokens are split out
        first, every piece is normalized, pre-tokenized and encoded alone), so the ids are
        the same as the whole text's."""
        if plan is None:
            plan = self.chat_plan(text)
        if plan is None:
            return self.encode(text, add_special_tokens=False)
        return self.assemble(plan)

    def assemble(self, plan: list[str | int]) -> list[int]:
        """The ids of a :meth:`chat_plan` from the piece cache (a piece not there is
        encoded, :meth:`encode_piece`, and kept; compiled:
        :func:`motor._fast.chatplan.assemble`)."""
        return _assemble(plan, 0, self.pieces, self.encode_piece)

    def plan_key(self, plan: list[str | int], block_size: int, salt: int = 0,
                 cut: int | None = None) -> tuple[int, npt.NDArray[np.uint64]]:
        """(token count, block hashes) of a :meth:`chat_plan`: the same as
        ``block_hashes(self.assemble(plan), block_size, 0, salt)``, without assembling or
        hashing again the leading elements seen before.

        The plan is cut before its first text piece not in :attr:`pieces` (a shared system
        prompt, earlier turns: before the new user turn); the hash chain's state after that
        prefix (its full blocks' hashes and the ids of its last partial block) is kept in
        :attr:`prefixes`, and only the rest is assembled and hashed, from the prefix's last
        hash on (``block_hashes``' ``parent``). ``cut``: that piece's index (``len(plan)``:
        none) when the caller found it with :attr:`pieces` as they are now
        (:meth:`Tokenizers.warm`), ``None``: found here. (Any cut gives the same result:
        it only decides which prefix is kept.)"""
        if cut is None:
            cut = plan_cut(plan, self.pieces._d)[0]
        if not cut:
            ids = self.assemble(plan)
            return len(ids), block_hashes(ids, block_size, 0, salt)
        prefixes = self.prefixes
        pk = (block_size, salt, *plan[:cut])
        st = prefixes.get(pk)
        if st is None:
            head = self.assemble(plan[:cut])
            full = len(head) - len(head) % block_size
            chars = sum(len(p) for p in plan[:cut] if type(p) is str)
            st = (len(head), block_hashes(head, block_size, 0, salt), head[full:], chars)
            prefixes[pk] = st
            self.prefix_chars += chars
            while len(prefixes) > 1 and (len(prefixes) > PREFIXES_MAX_ENTRIES
                                         or self.prefix_chars > PREFIXES_MAX_CHARS):
                self.prefix_chars -= prefixes.popitem(last=False)[1][3]
        else:
            prefixes.move_to_end(pk)
        n0, h0, tail, _ = st
        if cut == len(plan):
            return n0, h0
        ids = _assemble(plan, cut, self.pieces, self.encode_piece, tail)  # tail, then the rest
        n = n0 + len(ids) - len(tail)
        if len(ids) < block_size:
            return n, h0
        return n, extend_hashes(h0, ids, block_size, salt)

    @property
    def cuts_chats(self) -> bool:
        """Whether a chat's text is cut at the added tokens (:meth:`chat_plan` is not
        ``None``): its pieces' ids and its prefixes' hash chains are cached."""
        return self._split is not None

    @property
    def releases_gil(self) -> bool:
        """Whether :meth:`encode` runs outside the GIL (``tokenizers``; not ``builtin``)."""
        return self._tok is not None

    # -- completions ------------------------------------------------------------
    @staticmethod
    def completion_prompt(body: dict[str, Any]) -> str | list[int]:
        """The completion's routing prompt: its text, or its token ids as sent."""
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]  # a batch: the first prompt is the routing key
        if isinstance(p, str):
            return p
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            for t in p:     # (a loop: all() over a generator costs more)
                if not 0 <= t <= _MAX_TOKEN_ID:
                    raise TokenizeError(f"prompt token ids are expected to be in "
                                        f"0..{_MAX_TOKEN_ID}, got {t}")
            return p
        raise TokenizeError("prompt is expected to be a string, a list of token ids, or a list "
                            "of either")

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        p = self.completion_prompt(body)
        if isinstance(p, str):
            return self.encode(p, add_special_tokens=True)
        return p


#: pre-tokenizers that treat every piece alike wherever it is in the text (``Metaspace``
#: adds its prefix to the first piece only: not listed; unknown types are not either)
_PIECE_FREE_PRE_TOKENIZERS = frozenset((
    "ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
    "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"))


def _pieces_free(pt: Any) -> bool:
    if pt is None:
        return True
    if not isinstance(pt, dict):
        return False
    if pt.get("type") == "Sequence":
        return all(_pieces_free(x) for x in pt.get("pretokenizers") or [None])
    return pt.get("type") in _PIECE_FREE_PRE_TOKENIZERS


def piece_splitter(tokenizer_json: dict[str, Any]
                   ) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """How a ``tokenizer.json`` splits a text at its added tokens before anything else:
    (a regex matching them leftmost-longest, content -> id), or ``None`` when encoding
    the pieces alone might not give the whole text's ids: no added tokens; an added token
    that strips whitespace (``lstrip`` / ``rstrip``), matches whole words only
    (``single_word``) or after normalization (``normalized``); a pre-tokenizer that
    depends on a piece's place in the text (not in :data:`_PIECE_FREE_PRE_TOKENIZERS`);
    truncation, padding or BPE dropout."""
    if tokenizer_json.get("truncation") is not None or tokenizer_json.get("padding") is not None:
        return None
    model = tokenizer_json.get("model")
    if not isinstance(model, dict) or model.get("dropout") not in (None, 0, 0.0):
        return None
    if not _pieces_free(tokenizer_json.get("pre_tokenizer")):
        return None
    added: dict[str, int] = {}
    for t in tokenizer_json.get("added_tokens") or []:
        if not isinstance(t, dict) or t.get("lstrip") or t.get("rstrip") \
                or t.get("single_word") or t.get("normalized", True):
            return None
        c, i = t.get("content"), t.get("id")
        if not isinstance(c, str) or not c or not isinstance(i, int):
            return None
        added[c] = i
    if not added:
        return None
    # alternatives longest first: at the leftmost match, the longest token wins
    pattern = re.compile("|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)))
    return pattern, added


def _capturing(added: dict[str, int]) -> re.Pattern[str]:
    """:func:`piece_splitter`'s pattern in a capture group (``re.split`` keeps the tokens),
    the tokens' common prefix taken out of the alternation (the same matches; the regex
    engine then scans for the prefix literally: ``<|`` of ChatML's tokens)."""
    names = sorted(added, key=len, reverse=True)
    pre = os.path.commonprefix(names)
    alts = "|".join(re.escape(c[len(pre):]) for c in names)
    return re.compile(f"({re.escape(pre)}(?:{alts}))")


#: the ``ByteLevel`` pre-tokenizer's split (``use_regex``; GPT-2's pattern, as
#: ``tokenizers`` has it) for ASCII text: ``\p{L}`` is ``[A-Za-z]`` there, ``\p{N}``
#: ``[0-9]``, ``\s`` the six ASCII white-space characters (the contractions factored and the
#: runs possessive: the same matches, fewer steps)
_BYTE_LEVEL_ASCII = re.compile(
    r"'(?:[stmd]|re|ve|ll)| ?[A-Za-z]++| ?[0-9]++| ?[^\sA-Za-z0-9]++|\s+(?!\S)|\s+", re.ASCII)


#: ASCII characters -> their byte-level alphabet characters (GPT-2's ``bytes_to_unicode``:
#: printable bytes stand for themselves, the n-th of the others is U+0100 + n; in ASCII
#: that is 0x00-0x20 -> U+0100-U+0120 and 0x7F -> U+0121), for ``str.translate``: the table
#: :class:`motor._fast.pretok.ByteLevelMiss` applies (tested alike, and against the library)
_BYTE_CHARS = {**{b: 0x100 + b for b in range(0x21)}, 0x7F: 0x121}


def word_splitter(tokenizer_json: dict[str, Any]) -> re.Pattern[str] | None:
    """The pre-token split of ASCII text for a ``tokenizer.json`` whose text pieces encode
    to the concatenated ids of their pre-tokens encoded one by one (so the ids of a word
    can be kept and reused, :meth:`RoutingTokenizer.encode_piece`), or ``None``: that is a
    BPE model without dropout, no normalizer and exactly the ``ByteLevel`` pre-tokenizer
    with its regex and without ``add_prefix_space`` (GPT-2 and most byte-level BPE models;
    a ``Split`` pattern of another model is not translated)."""
    pt = tokenizer_json.get("pre_tokenizer")
    model = tokenizer_json.get("model")
    if tokenizer_json.get("normalizer") is not None or not isinstance(pt, dict) \
            or not isinstance(model, dict):
        return None
    if pt.get("type") != "ByteLevel" or not pt.get("use_regex", True) \
            or pt.get("add_prefix_space", True):
        return None
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return None
    return _BYTE_LEVEL_ASCII


def compiled_bpe(tokenizer_json: dict[str, Any]) -> ByteLevelBpe | None:
    """The merges of a :func:`word_splitter` tokenizer's BPE model compiled
    (:class:`motor._fast.bpe.ByteLevelBpe`: a missing word's ids without the library's
    ``Token`` objects), or ``None`` when the model has an option it does not apply
    (a continuing-subword prefix, an end-of-word suffix) or its merges do not load (the
    library's model then encodes the words, as before)."""
    model = tokenizer_json.get("model")
    if not isinstance(model, dict) or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        return None
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        return None
    try:
        return ByteLevelBpe(vocab, merges, bool(model.get("ignore_merges", False)))
    except ValueError as e:
        logger.info("routing tokenizer: BPE merges not compiled (%s); the library encodes "
                    "new words", e)
        return None


class WordCache:
    """Token ids of words (pre-tokens), bounded: two generations of at most ``max_words``
    each; when the current one is full it becomes the old one (the older is dropped), and a
    word found in the old one moves to the current one. Reads are one dict lookup."""

    __slots__ = ("max_words", "cur", "old")

    def __init__(self, max_words: int = WORDS_MAX) -> None:
        self.max_words = max_words
        self.cur: dict[str, list[int]] = {}
        self.old: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.cur) + len(self.old)

    def get_old(self, word: str) -> list[int] | None:
        """The ids of ``word`` from the old generation (moved to the current one)."""
        ids = self.old.pop(word, None)
        if ids is not None:
            self.put(word, ids)
        return ids

    def put(self, word: str, ids: list[int]) -> None:
        if len(self.cur) >= self.max_words:
            self.old = self.cur
            self.cur = {}
        self.cur[word] = ids


def _splice_plans_exact(prefix: str, names: tuple[str, ...]) -> bool:
    """Whether the added-token split of a spliced text is its segments' splits with the
    contents run in wherever no piece holding a content holds ``prefix`` (the tokens'
    common prefix; :func:`motor._fast.splice.plan_of`). Two kinds of token set break it: a
    token that is a proper prefix of another (a segment's last token and the content after
    it can make the longer one), and a prefix with a border, a proper suffix equal to its
    own start (``<<``: a content that ends in ``<`` and a segment's token that starts
    with ``<<`` can make a token that starts in the content); the text is split whole then.
    """
    if not prefix:
        return False
    if any(len(p) < len(q) and q.startswith(p) for p in names for q in names):
        return False
    return not any(prefix.endswith(prefix[:k]) for k in range(1, len(prefix)))


#: the chat request fields the template reads besides ``messages`` (the cache key)
_CHAT_KEY_FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "documents",
                    "chat_template_kwargs")


def _chat_key(src: str, body: dict[str, Any]) -> bytes | None:
    """The cache key of a chat's token ids: the tokenizer and every template input, as JSON
    bytes (``None``: not encodable, not cached). The two flags are keyed as
    :meth:`RoutingTokenizer.render_chat` reads them (``add_generation_prompt`` absent is
    true, ``null`` false), the other inputs as sent."""
    try:
        return orjson.dumps([src, body.get("messages"),
                             bool(body.get("add_generation_prompt", True)),
                             bool(body.get("continue_final_message", False)),
                             *(body.get(k) for k in _CHAT_KEY_FIELDS[2:])])
    except TypeError:
        return None


def _key_size(key: object, hashes: npt.NDArray[np.uint64]) -> int:
    """Bytes a :attr:`Tokenizers.keys` entry holds, about: its key (a chat's JSON bytes, a
    completion's (tokenizer, prompt text)) and 8 a hash."""
    if isinstance(key, bytes):
        n = len(key)
    elif isinstance(key, tuple):
        n = sum(len(x) for x in key if isinstance(x, str))
    else:
        n = 64
    return n + 8 * len(hashes)


class TokenCache:
    """LRU of token-id lists, bounded in entries and in tokens held (the newest entry is
    always kept, even alone above the token bound). ``hits`` / ``misses`` count lookups."""

    __slots__ = ("max_entries", "max_tokens", "tokens", "hits", "misses", "_d")

    def __init__(self, max_entries: int = CACHE_MAX_ENTRIES,
                 max_tokens: int = CACHE_MAX_TOKENS) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._d: OrderedDict[object, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def get(self, key: object) -> list[int] | None:
        ids = self._d.get(key)
        if ids is None:
            self.misses += 1
            return None
        self._d.move_to_end(key)
        self.hits += 1
        return ids

    def put(self, key: object, ids: list[int]) -> None:
        d = self._d
        old = d.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        d[key] = ids
        self.tokens += len(ids)
        while len(d) > 1 and (len(d) > self.max_entries or self.tokens > self.max_tokens):
            _, gone = d.popitem(last=False)
            self.tokens -= len(gone)


def uses_kv_router(c: CoordinatorConfig) -> bool:
    """Whether a coordinator with ``c`` makes a KV router (and so loads
    ``coordinator.kv.tokenizers``): policy ``kv_affinity``, or a PD mode whose prefill or
    decode policy is ``kv_affinity`` or that chooses pairs jointly."""
    kv = PolicyName.KV_AFFINITY
    if c.policy is kv:
        return True
    if c.mode is DeploymentMode.UNION:
        return False
    pd = c.pd
    return pd.prefill_policy is kv or pd.decode_policy is kv or pd.joint.enabled


def check_tokenizers(c: CoordinatorConfig) -> None:
    """Before a coordinator starts (``motor coordinator``, ``motor up``): load every tokenizer
    ``coordinator.kv.tokenizers`` names when :func:`uses_kv_router`, and drop them (a
    tokenizer refers to itself: collected here, not left to a process that never uses it).
    Raises :class:`~motor.errors.ConfigError` (:meth:`Tokenizers.load_all`'s)."""
    if not c.kv.tokenizers or not uses_kv_router(c):
        return
    try:
        Tokenizers(c.kv.tokenizers).load_all()
    finally:
        gc.collect()


class Tokenizers:
    """Routing tokenizers per model name, from ``coordinator.kv.tokenizers``: loaded by
    :meth:`load_all` (a KV router calls it when it is made), else at first use.

    ``mapping`` maps a model name (``"*"`` = any other model) to ``builtin`` or a model
    directory. A model with no entry uses ``builtin``.
    """

    def __init__(self, mapping: dict[str, str] | None = None, *,
                 cache: TokenCache | None = None,
                 off_loop_min_chars: int = OFF_LOOP_MIN_CHARS,
                 off_loop_threads: int = OFF_LOOP_THREADS) -> None:
        self.mapping = dict(mapping or {})
        self._cache: dict[str, RoutingTokenizer] = {}
        #: sources that failed to load -> their error (not read again on every request)
        self._failed: dict[str, str] = {}
        #: token ids of recent requests (see the module docstring)
        self.ids = cache if cache is not None else TokenCache()
        #: routing keys of recent requests that have a request key (:meth:`_key`: not a chat
        #: the tokenizer cuts into pieces): request key -> (block size, salt, tokens, block
        #: hashes); ``key_hits`` / ``key_misses`` count lookups
        self.keys: OrderedDict[object, tuple[int, int, int, npt.NDArray[np.uint64]]] = \
            OrderedDict()
        self.key_hits = 0
        self.key_misses = 0
        #: bytes held by :attr:`keys` (keys and hashes)
        self.key_bytes = 0
        self.off_loop_min_chars = off_loop_min_chars
        self.off_loop_threads = off_loop_threads
        self._pool: ThreadPoolExecutor | None = None
        #: what :meth:`warm` computed for a body it did not hand to the pool: (body, route,
        #: tokenizer, cache key, completion prompt, rendered chat text, its plan, the index
        #: of the plan's first text piece not in the piece cache), for the :meth:`block_key`
        #: or :meth:`token_ids` of the same body that follows (one key, one jinja render and
        #: one scan of the plan a request, not two); the body is compared by identity. The
        #: piece cache is the same then: nothing went to the pool
        self._rendered: tuple[dict[str, Any], str, RoutingTokenizer, object,
                              str | list[int] | None, str | None,
                              list[str | int] | None, int | None] | None = None

    def load_all(self) -> None:
        """Load now every tokenizer :attr:`mapping` names (when a worker's KV router is made:
        the first request of a model does not wait on the event loop for its files, and a
        directory that cannot be read is found before requests are routed on load alone).
        Every entry is tried; those that load are kept.

        Raises :class:`~motor.errors.ConfigError` naming each entry that failed
        (``coordinator.kv.tokenizers['<model>']: <why>``, ``; `` between them) when a
        directory lacks tokenizer.json or tokenizer_config.json, one cannot be read, or the
        chat template is not valid jinja2 (:class:`RoutingTokenizer`'s errors)."""
        errors = []
        for model, src in self.mapping.items():
            try:
                self._load(src)
            except ValueError as e:
                errors.append(f"coordinator.kv.tokenizers[{model!r}]: {e}")
                continue
            logger.info("routing tokenizer for model %s: %s", model, src)
        if errors:
            raise ConfigError("; ".join(errors))

    def _load(self, src: str) -> RoutingTokenizer:
        """The tokenizer of ``src``, loaded once; a source that failed to load fails again
        with the same error without reading its files (until the process restarts)."""
        tok = self._cache.get(src)
        if tok is not None:
            return tok
        err = self._failed.get(src)
        if err is not None:
            raise ValueError(err)
        try:
            tok = self._cache[src] = RoutingTokenizer(src)
        except ValueError as e:
            self._failed[src] = str(e)
            raise
        return tok

    def get(self, model: str | None) -> RoutingTokenizer:
        """The tokenizer of ``model`` (its entry, else ``*``'s, else ``builtin``); raises
        ``ValueError`` when its directory cannot be loaded (:meth:`_load`)."""
        src = self.mapping.get(model or "", self.mapping.get("*", BUILTIN))
        tok = self._cache.get(src)
        if tok is None:
            tok = self._load(src)
            logger.info("routing tokenizer for model %s: %s", model or "*", src)
        return tok

    def _key(self, tok: RoutingTokenizer, route: str,
             body: dict[str, Any]) -> tuple[object, str | list[int] | None]:
        """(request key or ``None``, the completion's prompt; ``None`` for a chat). A chat the
        tokenizer cuts into pieces (:attr:`RoutingTokenizer.cuts_chats`) has no request key:
        its pieces and prefixes are its cache (the module docstring)."""
        if route == "chat":
            return (None if tok.cuts_chats else _chat_key(tok.source, body)), None
        p = RoutingTokenizer.completion_prompt(body)
        return ((tok.source, p) if isinstance(p, str) else None), p

    def _take(self, route: str, body: dict[str, Any]
              ) -> tuple[RoutingTokenizer, object, str | list[int] | None, str | None,
                         list[str | int] | None, int | None]:
        """(tokenizer, cache key, completion prompt, rendered chat text, its plan, the
        plan's cut for :meth:`RoutingTokenizer.plan_key`) of a body: what :meth:`warm`
        computed when it saw this very body just before (taken once), else the tokenizer
        and key (text, plan and cut ``None``: not rendered yet)."""
        r = self._rendered
        self._rendered = None
        if r is not None and r[0] is body and r[1] == route:   # warm() saw it just before
            return r[2], r[3], r[4], r[5], r[6], r[7]
        tok = self.get(body.get("model"))
        key, prompt = self._key(tok, route, body)
        return tok, key, prompt, None, None, None

    def token_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        """Token ids of a request body; ``route`` is ``chat`` or ``completions``. The list
        may be the cache's own: read it, do not change it.

        Raises
        ------
        TokenizeError
            when the body cannot be tokenized (the engine will judge the request).
        """
        tok, key, prompt, text, plan, _ = self._take(route, body)
        if key is None and prompt is None and tok.cuts_chats:
            key = _chat_key(tok.source, body)       # whole id lists: a key of their own
        if key is None:
            return tok.chat_ids(body) if prompt is None else tok.completion_ids(body)
        ids = self.ids.get(key)
        if ids is None:
            if prompt is not None:
                ids = tok.completion_ids(body)
            elif plan is not None:
                ids = tok.assemble(plan)
            elif text is not None:
                ids = tok.encode_chat(text, None)
            else:
                ids = tok.chat_ids(body)
            self.ids.put(key, ids)
        return ids

    def block_key(self, route: str, body: dict[str, Any], block_size: int,
                  salt: int = 0) -> tuple[int, npt.NDArray[np.uint64]]:
        """The routing key of a request body: (prompt tokens, uint64 hashes of its full
        blocks of ``block_size`` tokens, ``salt`` folded in), the same as
        ``block_hashes(self.token_ids(route, body), block_size, 0, salt)``.

        A chat the tokenizer cuts into pieces: its leading plan elements seen before are not
        assembled nor hashed again (:meth:`RoutingTokenizer.plan_key`); any other request's
        key is kept in :attr:`keys` (LRU, :data:`KEYS_MAX_ENTRIES`). The array may be a
        cache's own: read it.

        Raises
        ------
        TokenizeError
            when the body cannot be tokenized (the engine will judge the request).
        """
        r = self._rendered
        if r is not None and r[0] is body and r[6] is not None and r[3] is None \
                and r[1] == route:
            # warm() planned this very chat just before, and it has no request key (cut into
            # pieces): the key from the plan, without _take's general path
            self._rendered = None
            return r[2].plan_key(r[6], block_size, salt, r[7])
        tok, key, prompt, text, plan, cut = self._take(route, body)
        keys = self.keys
        if key is not None:
            got = keys.get(key)
            if got is not None and got[0] == block_size and got[1] == salt:
                keys.move_to_end(key)
                self.key_hits += 1
                return got[2], got[3]
            self.key_misses += 1
        ids = self.ids._d.get(key) if key is not None else None   # the pool encoded it
        res: tuple[int, npt.NDArray[np.uint64]] | None = None
        if ids is None:
            if prompt is not None:
                ids = tok.completion_ids(body)
            else:
                if text is None and plan is None:
                    text, plan = tok.plan_chat(body)
                if plan is not None:
                    res = tok.plan_key(plan, block_size, salt, cut)
                else:
                    assert text is not None         # plan_chat gives one of them
                    ids = tok.encode_chat(text, None)
        if res is None:
            assert ids is not None
            res = (len(ids), block_hashes(ids, block_size, 0, salt))
        if key is not None:
            old = keys.pop(key, None)
            if old is not None:
                self.key_bytes -= _key_size(key, old[3])
            keys[key] = (block_size, salt, res[0], res[1])
            self.key_bytes += _key_size(key, res[1])
            while len(keys) > 1 and (len(keys) > KEYS_MAX_ENTRIES
                                     or self.key_bytes > KEYS_MAX_BYTES):
                k, v = keys.popitem(last=False)
                self.key_bytes -= _key_size(k, v[3])
        return res

    def warm(self, route: str, body: dict[str, Any]) -> asyncio.Future[Any] | None:
        """Start encoding a long request in the thread pool (the running loop's executor
        hand-off); once the future is done its ids are cached, so :meth:`token_ids` finds
        them (the future's own result is not the ids). ``None`` when there is nothing to
        wait for: cached, short (what is not cached under :attr:`off_loop_min_chars`
        characters), a token-id prompt, a tokenizer that holds the GIL (``builtin``), or a
        body that cannot be tokenized (:meth:`token_ids` says why). What it computed for a
        body it returns ``None`` for (request key, rendered chat) is kept for the
        :meth:`block_key` or :meth:`token_ids` of the same body that follows. A chat cut
        into pieces: only its pieces not cached go to the pool, and they land in the piece
        cache."""
        self._rendered = None
        try:
            tok = self.get(body.get("model"))
            if not tok.releases_gil:
                return None
            key: object = None
            prompt: str | list[int] | None = None
            if route != "chat" or not tok.cuts_chats:   # (a cut chat has no request key)
                key, prompt = self._key(tok, route, body)
                if key is None:
                    return None     # a token-id prompt, a chat whose key cannot be made
            if key is not None and (key in self.keys or key in self.ids._d):
                self._rendered = (body, route, tok, key, prompt, None, None, None)
                return None
            plan = None
            text: str | None
            if prompt is None:
                text, plan = tok.plan_chat(body)  # jinja: Python, holds the GIL anyway
            else:
                assert isinstance(prompt, str)
                text = prompt
        except (TokenizeError, ValueError):
            return None
        if plan is not None:
            # the first text piece not cached (plan_key's cut), and the text not cached
            cut, new_chars = plan_cut(plan, tok.pieces._d)
            if new_chars < self.off_loop_min_chars:
                self._rendered = (body, route, tok, key, None, text, plan, cut)
                return None
            return self._encode_pieces(tok, plan)
        if text is None or len(text) < self.off_loop_min_chars:
            self._rendered = (body, route, tok, key, prompt, text if prompt is None else None,
                              None, None)
            return None
        return self._encode_text(tok, key, text, prompt is not None)

    def _encode_pieces(self, tok: RoutingTokenizer, plan: list[str | int]
                       ) -> asyncio.Future[Any]:
        """:meth:`warm` of a plan with much new text: its pieces not cached, encoded in the
        pool, land in the piece cache (touched on the loop)."""
        missing = list(dict.fromkeys(p for p in plan
                                     if isinstance(p, str) and p not in tok.pieces))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().run_in_executor(
            self._executor(), tok.encode_pieces, missing)

        def keep_pieces(f: asyncio.Future[list[list[int]]]) -> None:
            if not f.cancelled() and f.exception() is None:
                for piece, got in zip(missing, f.result()):
                    tok.pieces.put(piece, got)
        fut.add_done_callback(keep_pieces)
        return fut

    def _encode_text(self, tok: RoutingTokenizer, key: object, text: str,
                     special: bool) -> asyncio.Future[Any]:
        """:meth:`warm` of a long text encoded whole: its ids land in :attr:`ids`."""
        ids_cache = self.ids
        fut: asyncio.Future[Any] = asyncio.get_running_loop().run_in_executor(
            self._executor(), tok.encode, text, special)

        def keep(f: asyncio.Future[list[int]]) -> None:
            if not f.cancelled() and f.exception() is None:
                ids_cache.put(key, f.result())
        fut.add_done_callback(keep)
        return fut

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.off_loop_threads,
                                            thread_name_prefix="motor-tokenize")
        return self._pool

    def close(self) -> None:
        """Stop the encode pool (threads end after their current encode)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
