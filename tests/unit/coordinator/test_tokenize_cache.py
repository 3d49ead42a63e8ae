"""The routing key's cost (tokenize.py): the token-id LRU and the off-loop encode of long
texts, which must give exactly the ids the inline path gives."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from motor.config.schema import KvRoutingConfig
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.policy import RequestInfo
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.coordinator.tokenize import (BUILTIN, RoutingTokenizer, TokenCache, Tokenizers,
                                        piece_splitter)
from motor.sim.tokenizer import write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("tok")))


def chat(text: str, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}], **extra}


@pytest.mark.parametrize("source", ["dir", BUILTIN])
def test_a_request_seen_again_costs_a_lookup(model_dir: str, source: str) -> None:
    toks = Tokenizers({"*": model_dir if source == "dir" else BUILTIN})
    ids = toks.token_ids("chat", chat("hello"))
    assert toks.ids.misses == 1 and toks.ids.hits == 0
    assert toks.token_ids("chat", chat("hello")) is ids
    assert toks.ids.hits == 1
    want = RoutingTokenizer(model_dir if source == "dir" else BUILTIN).chat_ids(chat("hello"))
    assert ids == want


def test_every_template_input_is_part_of_the_key(model_dir: str) -> None:
    toks = Tokenizers({"*": model_dir})
    a = toks.token_ids("chat", chat("hi"))
    b = toks.token_ids("chat", chat("hi", add_generation_prompt=False))
    c = toks.token_ids("chat", chat("hi", max_tokens=5, temperature=0.5))   # not an input
    assert a != b and c is a and len(toks.ids) == 2


def test_completion_prompts_text_cached_ids_as_sent(model_dir: str) -> None:
    toks = Tokenizers({"*": model_dir})
    body = {"model": "m", "prompt": "some text"}
    assert toks.token_ids("completions", body) is toks.token_ids("completions", body)
    sent = {"model": "m", "prompt": [5, 6, 7]}
    assert toks.token_ids("completions", sent) == [5, 6, 7]
    assert len(toks.ids) == 1


def test_the_cache_is_bounded_in_entries_and_tokens() -> None:
    c = TokenCache(max_entries=3, max_tokens=10)
    for k in range(5):
        c.put(k, [k] * 2)
    assert len(c) == 3 and 0 not in c and 4 in c and c.tokens == 6
    c.put("big", list(range(9)))            # over the token bound: the oldest go
    assert len(c) == 1 and "big" in c and c.tokens == 9
    c.put(7, [7])
    assert len(c) == 2 and c.tokens == 10
    c.put("huge", list(range(50)))          # the newest is kept even alone above the bound
    assert len(c) == 1 and c.get("huge") is not None and c.tokens == 50
    c.get(None)
    assert c.misses == 1


def test_a_long_text_is_encoded_off_the_loop_to_the_same_ids(model_dir: str) -> None:
    toks = Tokenizers({"*": model_dir}, off_loop_min_chars=1000)
    long_body = chat("x y z " * 400)
    short_body = chat("short")

    async def run() -> None:
        assert toks.warm("chat", short_body) is None
        fut = toks.warm("chat", long_body)
        assert fut is not None
        await fut
        assert toks.warm("chat", long_body) is None        # cached now

    try:
        asyncio.run(run())
    finally:
        toks.close()
    tok = RoutingTokenizer(model_dir)
    whole = tok._tok.encode(tok.render_chat(long_body), add_special_tokens=False).ids
    assert toks.token_ids("chat", long_body) == whole
    assert toks.ids.hits == 1


def test_builtin_and_token_id_prompts_stay_inline() -> None:
    toks = Tokenizers({"*": BUILTIN}, off_loop_min_chars=10)

    async def run() -> None:
        assert toks.warm("chat", chat("x" * 100)) is None
        assert toks.warm("completions", {"model": "m", "prompt": list(range(100))}) is None
        assert toks.warm("chat", {"model": "m", "messages": "not a list"}) is None
    asyncio.run(run())


def test_kv_affinity_fills_the_key_alike_inline_and_off_loop(model_dir: str) -> None:
    cfg = KvRoutingConfig.model_validate({"tokenizers": {"*": model_dir}})
    inline, off = KvAffinity(KvRouter(cfg)), KvAffinity(KvRouter(cfg))
    off.router.tokenizers.off_loop_min_chars = 1000
    body = chat("w " * 2000)
    a, b = RequestInfo("m", 1, 16), RequestInfo("m", 1, 16)
    assert inline.prepare(a, "chat", body) is None

    async def run() -> None:
        later = off.prepare(b, "chat", body, off_loop=True)
        assert later is not None
        await later
    try:
        asyncio.run(run())
    finally:
        off.router.tokenizers.close()
    assert a.prompt_tokens == b.prompt_tokens > 1000
    assert list(a.block_hashes) == list(b.block_hashes)


_words = st.sampled_from(["hello", " world", "\n", "  ", "<|im_end|>", "<|im_start|>",
                          "<|endoftext|>", "<|im_", "end|>", "ünï", "✓", "\t", "12345", "'s",
                          "assistant", "user\n"])
_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.lists(_words, max_size=12).map("".join)}), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_messages, st.booleans())
def test_chat_pieces_encode_to_the_whole_texts_ids(model_dir: str, messages: list,
                                                   add_gen: bool) -> None:
    tok = _shared_tokenizer(model_dir)
    body = {"messages": messages, "add_generation_prompt": add_gen}
    text = tok.render_chat(body)
    assert tok.chat_plan(text) is not None
    assert tok.chat_ids(body) == tok._tok.encode(text, add_special_tokens=False).ids


_TOKENIZERS: dict[str, RoutingTokenizer] = {}


def _shared_tokenizer(model_dir: str) -> RoutingTokenizer:
    """One tokenizer across examples: later ones meet pieces cached by earlier ones."""
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = RoutingTokenizer(model_dir)
    return _TOKENIZERS[model_dir]


def test_a_short_chat_is_rendered_once_for_warm_then_token_ids(model_dir: str) -> None:
    async def main() -> None:
        toks = Tokenizers({"*": model_dir})
        tok = toks.get("m")
        renders = []
        render = tok.render_chat
        tok.render_chat = lambda body: renders.append(1) or render(body)  # type: ignore[method-assign]
        body = chat("a short question")
        assert toks.warm("chat", body) is None              # short: stays on the loop
        ids = toks.token_ids("chat", body)
        assert len(renders) == 1                            # warm's render was reused
        assert ids == RoutingTokenizer(model_dir).chat_ids(body)
        other = chat("another one")
        assert toks.warm("chat", other) is None
        toks.token_ids("chat", dict(other))                 # not the body warm saw
        assert len(renders) == 3
    asyncio.run(main())


def test_a_shared_system_prompt_is_encoded_once(model_dir: str) -> None:
    tok = RoutingTokenizer(model_dir)
    tok.chat_ids(chat("one"))
    n = len(tok.pieces)
    tok.chat_ids(chat("two"))
    assert len(tok.pieces) == n + 1            # only the new user turn was encoded


@pytest.mark.parametrize("change", [
    {"pre_tokenizer": {"type": "Metaspace", "replacement": "_", "prepend_scheme": "first"}},
    {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel"}, {"type": "SomethingNew"}]}},
    {"truncation": {"max_length": 8}},
    {"added_tokens": [{"id": 1, "content": "<s>", "lstrip": True, "rstrip": False,
                       "single_word": False, "normalized": False}]},
    {"added_tokens": [{"id": 1, "content": "<s>", "lstrip": False, "rstrip": False,
                       "single_word": False, "normalized": True}]},
    {"added_tokens": []},
], ids=["metaspace first", "unknown pre-tokenizer", "truncation", "lstrip", "normalized",
        "no added tokens"])
def test_tokenizers_whose_pieces_might_differ_are_encoded_whole(model_dir: str,
                                                                change: dict) -> None:
    tj = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    assert piece_splitter(tj) is not None
    assert piece_splitter({**tj, **change}) is None
