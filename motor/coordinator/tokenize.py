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
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from motor.protocol import chat_tokenizer

logger = logging.getLogger(__name__)

BUILTIN = "builtin"


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
        when the directory or its files are missing or unreadable.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._tok: Any = None
        self._template: Any = None
        self._bos: str | None = None
        self._eos: str | None = None
        if source == BUILTIN:
            return
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        d = Path(source).expanduser()
        try:
            self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
            with open(d / "tokenizer_config.json", encoding="utf-8") as f:
                cfg = json.load(f)
        except Exception as e:  # noqa: BLE001 - file missing / malformed: one clear error
            raise ValueError(f"tokenizer directory {str(d)!r} is expected to hold tokenizer.json "
                             f"and tokenizer_config.json: {e}") from None

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
            self._template = env.from_string(tmpl)

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
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizeError("messages is expected to be a list of objects")
        add_gen = body.get("add_generation_prompt", True)
        cont = bool(body.get("continue_final_message", False))
        if self._template is None and self._tok is None:
            try:
                return chat_tokenizer.render_chat(messages, add_generation_prompt=bool(add_gen),
                                                  continue_final_message=cont)
            except ValueError as e:
                raise TokenizeError(str(e)) from None
        if self._template is None:
            raise TokenizeError(f"tokenizer {self.source!r} has no chat_template")
        kwargs: dict[str, Any] = {}
        extra = body.get("chat_template_kwargs")
        if isinstance(extra, dict):
            kwargs.update(extra)
        for k in ("tools", "documents"):
            if body.get(k) is not None:
                kwargs[k] = body[k]
        try:
            text: str = self._template.render(
                messages=messages, add_generation_prompt=bool(add_gen) and not cont,
                bos_token=self._bos or "", eos_token=self._eos or "", **kwargs)
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

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        return self.encode(self.render_chat(body), add_special_tokens=False)

    # -- completions ------------------------------------------------------------
    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]  # a batch: the first prompt is the routing key
        if isinstance(p, str):
            return self.encode(p, add_special_tokens=True)
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return p
        raise TokenizeError("prompt is expected to be a string, a list of token ids, or a list "
                            "of either")


class Tokenizers:
    """Routing tokenizers per model name, loaded lazily from ``coordinator.kv.tokenizers``.

    ``mapping`` maps a model name (``"*"`` = any other model) to ``builtin`` or a model
    directory. A model with no entry uses ``builtin``.
    """

    def __init__(self, mapping: dict[str, str] | None = None) -> None:
        self.mapping = dict(mapping or {})
        self._cache: dict[str, RoutingTokenizer] = {}

    def get(self, model: str | None) -> RoutingTokenizer:
        src = self.mapping.get(model or "", self.mapping.get("*", BUILTIN))
        tok = self._cache.get(src)
        if tok is None:
            tok = self._cache[src] = RoutingTokenizer(src)
            logger.info("routing tokenizer for model %s: %s", model or "*", src)
        return tok

    def token_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        """Token ids of a request body; ``route`` is ``chat`` or ``completions``.

        Raises
        ------
        TokenizeError
            when the body cannot be tokenized (the engine will judge the request).
        """
        tok = self.get(body.get("model"))
        if route == "chat":
            return tok.chat_ids(body)
        return tok.completion_ids(body)
