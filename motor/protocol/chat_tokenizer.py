"""The builtin chat tokenizer: byte-level token ids and a ChatML-style chat template.

``motor sim`` (the engine side, :mod:`motor.sim.tokenizer`, which writes these as a model
directory) and the coordinator (the routing key, :mod:`motor.coordinator.tokenize`'s
``builtin``, which computes them without files) must give a request the very same token
ids; both take them from here.

Token ids: every UTF-8 byte is one token whose id is the byte value (0..255), plus three
special tokens ``<|endoftext|>`` = 256, ``<|im_start|>`` = 257 and ``<|im_end|>`` = 258
(vocabulary of 259). A special-token string inside a text is that special token.

Chat template (ChatML-like): each message renders as
``<|im_start|>{role}\\n{content}<|im_end|>\\n``; with ``add_generation_prompt`` the prompt
ends with ``<|im_start|>assistant\\n``. A content given as a list of parts is the
``\\n``-join of its text parts (what vLLM does for "string" templates); a missing / null
content is empty. ``[{"role": "user", "content": "hi"}]`` is therefore 21 tokens.
:data:`CHAT_TEMPLATE` is the Jinja2 source (for model directories and real engines),
:func:`render_chat` the same rendering in Python.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
VOCAB_SIZE = 259
#: ids that end generation (the model's eos list: <|im_end|> first, like the real engine's config)
EOS_TOKEN_IDS = (IM_END_ID, ENDOFTEXT_ID)

#: Where ``motor sim`` writes its tokenizer model directory unless told otherwise
#: (``~`` not expanded).
SIM_TOKENIZER_DIR = os.path.join("~", ".cache", "motor", "sim-tokenizer")

# Jinja2 source. String content is used as is; a list of content parts contributes its text
# parts joined by "\n"; a missing / null content is empty.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is none -%}{%- set content = '' -%}"
    "{%- elif content is not string -%}"
    "{%- set content = content | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ content ~ '<|im_end|>' ~ '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SPECIAL_IDS = {ENDOFTEXT: ENDOFTEXT_ID, IM_START: IM_START_ID, IM_END: IM_END_ID}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_MESSAGE_END = IM_END + "\n"
_GENERATION_PROMPT = IM_START + "assistant\n"


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes, each special-token string as its id.

    Returns a new list of ints in ``0 .. VOCAB_SIZE - 1``; no special token is added.
    """
    out: list[int] = []
    for part in _SPECIAL_SPLIT.split(text):
        sid = _SPECIAL_IDS.get(part)
        if sid is not None:
            out.append(sid)
        elif part:
            out.extend(part.encode("utf-8"))
    return out


def content_text(content: Any) -> str:
    """The text a message ``content`` contributes to the prompt.

    ``None`` is empty, a string is used as is, a list of parts is the ``\\n``-join of the
    ``text`` of its ``{"type": "text"}`` parts (other parts are left out).

    Raises
    ------
    ValueError
        for any other type of content.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content
                         if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"message content is expected to be a string or a list of parts, "
                     f"got {type(content).__name__}")


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text of a chat under the builtin template (see the module docstring).

    ``messages`` are mappings with ``role`` and ``content``. ``continue_final_message``
    (with at least one message) drops the final message's ``<|im_end|>\\n`` and adds no
    generation prompt.

    Raises
    ------
    ValueError
        when a message's content is neither null, a string nor a list of parts.
    """
    text = "".join(f"{IM_START}{m.get('role')}\n{content_text(m.get('content'))}{_MESSAGE_END}"
                   for m in messages)
    if continue_final_message and messages:
        return text[: -len(_MESSAGE_END)]
    if add_generation_prompt:
        text += _GENERATION_PROMPT
    return text
