"""Synthetic workloads for ``motor bench``: random, shared-prefix, multi-turn.

Every dataset is a list of :class:`Conversation`; a single-turn dataset is a
list of one-turn conversations.  The runner sends the turns of one
conversation one after the other, each turn carrying the history so far
(previous user messages and the assistant's actual answers).

Lengths are in *tokens* counted as UTF-8 bytes (the simulated engine's
tokenizer is one token per byte) and all text is ASCII, so a text of N
characters is N tokens there.  With a real tokenizer the counts differ; the
bench reports the server's own counts from ``usage``.

Everything is deterministic from ``seed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from motor.bench.config import DATASETS

# 26 letters and 6 spaces: word-like ASCII text, one byte per character.
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", dtype=np.uint8)


@dataclass(frozen=True)
class Conversation:
    """One conversation: an optional system prompt and its user turns.

    ``max_tokens[i]`` is the output length asked for turn ``i``.
    ``group`` is the shared-prefix group (``None`` for the random dataset).
    """
    id: int
    system: str | None
    turns: tuple[str, ...]
    max_tokens: tuple[int, ...]
    group: int | None = None


def random_text(rng: np.random.Generator, n: int) -> str:
    """``n`` ASCII characters (= ``n`` byte tokens) of word-like random text."""
    if n <= 0:
        return ""
    codes = rng.integers(0, len(_ALPHABET), size=n)
    text = bytearray(_ALPHABET[codes].tobytes())
    text[0] = ord("a") + int(codes[0]) % 26  # never start with a space
    return text.decode("ascii")


def sample_len(rng: np.random.Generator, length: int, range_ratio: float) -> int:
    """A length uniform in ``[length*(1-r), length*(1+r)]`` (integers), at least 1."""
    if range_ratio <= 0 or length <= 0:
        return max(1, length)
    lo = max(1, int(round(length * (1.0 - range_ratio))))
    hi = max(lo, int(round(length * (1.0 + range_ratio))))
    return int(rng.integers(lo, hi + 1))


def _prefix(rng: np.random.Generator, n: int) -> str:
    """A shared system prompt of exactly ``n`` tokens ending with a newline."""
    if n <= 0:
        return ""
    return random_text(rng, n - 1) + "\n"


def build_dataset(
    name: str,
    *,
    num_requests: int = 100,
    input_len: int = 256,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 1024,
    num_groups: int = 4,
    num_conversations: int = 16,
    turns: int = 4,
    seed: int = 0,
) -> list[Conversation]:
    """Build the named dataset (one of :data:`DATASETS`).

    * ``random``: ``num_requests`` one-turn conversations, prompt of
      ``input_len`` tokens (± ``range_ratio``), no system prompt.
    * ``shared-prefix``: ``num_requests`` one-turn conversations; request i is
      in group ``i % num_groups`` whose system prompt (``prefix_len`` tokens)
      all its requests share, plus a unique question of ``input_len`` tokens.
    * ``multi-turn``: ``num_conversations`` conversations of ``turns`` user
      turns of ``input_len`` tokens each; conversation c uses the system
      prompt of group ``c % num_groups`` (``prefix_len`` tokens, none if 0).

    Output lengths are ``output_len`` (± ``range_ratio``).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    if range_ratio < 0 or range_ratio >= 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    convs: list[Conversation] = []
    if name == "random":
        for i in range(num_requests):
            n_in = sample_len(rng, input_len, range_ratio)
            n_out = sample_len(rng, output_len, range_ratio)
            convs.append(Conversation(i, None, (random_text(rng, n_in),), (n_out,)))
        return convs

    groups = max(1, num_groups)
    prefixes = [_prefix(rng, prefix_len) for _ in range(groups)]
    if name == "shared-prefix":
        for i in range(num_requests):
            g = i % groups
            n_in = sample_len(rng, input_len, range_ratio)
            n_out = sample_len(rng, output_len, range_ratio)
            convs.append(Conversation(i, prefixes[g] or None, (random_text(rng, n_in),),
                                      (n_out,), group=g))
        return convs

    # multi-turn
    for c in range(num_conversations):
        g = c % groups
        users = []
        outs = []
        for _ in range(max(1, turns)):
            users.append(random_text(rng, sample_len(rng, input_len, range_ratio)))
            outs.append(sample_len(rng, output_len, range_ratio))
        convs.append(Conversation(c, prefixes[g] or None, tuple(users), tuple(outs), group=g))
    return convs


def chat_messages(system: str | None, history: list[tuple[str, str]], user: str) -> list[dict]:
    """OpenAI chat messages: system, then the (user, assistant) history, then ``user``."""
    msgs: list[dict] = []
    if system:
        msgs.append({"role": "system", "content": system})
    for u, a in history:
        msgs.append({"role": "user", "content": u})
        msgs.append({"role": "assistant", "content": a})
    msgs.append({"role": "user", "content": user})
    return msgs


def completion_prompt(system: str | None, history: list[tuple[str, str]], user: str,
                      dialog: bool | None = None) -> str:
    """The same conversation as one text prompt for ``/v1/completions``.

    Without ``dialog`` (one-turn conversations) the prompt is ``system + user``
    exactly, so its length is ``prefix_len + input_len``.  With ``dialog``
    (multi-turn conversations, the default when there is history) it is the
    system prompt followed by ``User:``/``Assistant:`` lines ending with
    ``Assistant:``, so every turn's prompt starts with the previous one's.
    """
    if dialog is None:
        dialog = bool(history)
    if not dialog:
        return (system or "") + user
    parts = [system or ""]
    for u, a in history:
        parts.append(f"User: {u}\nAssistant: {a}\n")
    parts.append(f"User: {user}\nAssistant:")
    return "".join(parts)
