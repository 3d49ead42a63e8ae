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
from motor._fast.hashing import block_hashes
from motor.coordinator.tokenize import (BUILTIN, RoutingTokenizer, TokenCache, Tokenizers,
                                        WordCache, piece_splitter, word_splitter)
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
    pieces = toks.get("m").pieces
    misses = pieces.misses
    assert toks.token_ids("chat", long_body) == whole
    assert pieces.misses == misses              # every piece came from what the pool encoded


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
    plan = tok.chat_plan(text)
    assert plan is not None
    spliced, got = tok.plan_chat(body)      # the splice's plan, or (a prefix in a content)
    assert got == plan and spliced in (None, text)      # the text's
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
        render = tok.plan_chat
        tok.plan_chat = lambda body: renders.append(1) or render(body)  # type: ignore[method-assign]
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


# -- word cache (ASCII pieces of byte-level BPE tokenizers) and routing keys -------------

@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: str) -> str:
    """A byte-level BPE with merges (trained here on a small text), beside the sim's
    merge-free one: the word path must give the library's ids with merges too."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["You are a helpful assistant. Answer concisely and accurately. "
            "Question 12-345: don't we'll it's routers, gateways\tand   spaces\n\n 2024"] * 50
    tk.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    d = tmp_path_factory.mktemp("bpe")
    tk.save(str(d / "tokenizer.json"))
    tj = json.loads((d / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        t["normalized"] = False
    (d / "tokenizer.json").write_text(json.dumps(tj))
    (d / "tokenizer_config.json").write_text((Path(model_dir) / "tokenizer_config.json")
                                              .read_text())
    return str(d)


_ascii_text = st.lists(st.one_of(
    st.text(st.characters(max_codepoint=127), max_size=6),
    st.sampled_from(["'s", "'ll", "'re", "'", " x", "  ", "   y", "\n\n", " 123", "don't",
                     "\t ", " !!", "\x0b", "\x1c"])), max_size=12).map("".join)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_ascii_text)
def test_ascii_pieces_encoded_word_by_word_give_the_librarys_ids(model_dir: str, bpe_dir: str,
                                                                  text: str) -> None:
    for d in (model_dir, bpe_dir):
        tok = _shared_tokenizer(d)
        assert tok._words_re is not None
        if "<|" in text:
            continue
        want = tok._tok.encode(text, add_special_tokens=False).ids
        assert tok.encode_piece(text) == want
        assert tok.encode_piece(text) == want          # the words now from the cache


def test_the_byte_level_alphabet_of_ascii_is_the_librarys() -> None:
    from tokenizers.pre_tokenizers import ByteLevel

    from motor.coordinator.tokenize import _BYTE_CHARS
    text = "".join(map(chr, range(128)))
    pt = ByteLevel(add_prefix_space=False, use_regex=False)
    assert "".join(w for w, _ in pt.pre_tokenize_str(text)) == text.translate(_BYTE_CHARS)


@pytest.mark.parametrize("change", [
    {"normalizer": {"type": "NFC"}},
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}},
    {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}},
    {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\d"}, "behavior": "Isolated"},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}},
    {"model": {"type": "WordPiece", "vocab": {}}},
], ids=["normalizer", "prefix space", "no regex", "split pattern", "not bpe"])
def test_tokenizers_whose_words_might_differ_are_encoded_by_piece(model_dir: str,
                                                                  change: dict) -> None:
    tj = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    assert word_splitter(tj) is not None
    assert word_splitter({**tj, **change}) is None


def test_the_word_cache_is_bounded() -> None:
    c = WordCache(max_words=2)
    for w in "abcde":
        c.put(w, [ord(w)])
    assert len(c) <= 4 and c.cur == {"e": [101]}
    assert c.get_old("d") == [100] and "d" in c.cur and c.get_old("a") is None


def test_a_missing_words_ids_are_the_models_in_the_byte_level_alphabet(model_dir: str,
                                                                      bpe_dir: str) -> None:
    from motor._fast.pretok import ByteLevelMiss
    from motor.coordinator.tokenize import _BYTE_CHARS
    for d in (model_dir, bpe_dir):
        model = RoutingTokenizer(d)._model
        words = [chr(c) for c in range(128)] + [" hello", "world", "\x7f\x00 x", "12345",
                                                "'s", " \n", "hello"]
        got, ref = WordCache(max_words=5), WordCache(max_words=5)
        miss = ByteLevelMiss(got, model)
        for w in words:
            ids = [t.id for t in model.tokenize(w.translate(_BYTE_CHARS))]
            assert miss(w) == ids, repr(w)
            if ref.get_old(w) is None:          # WordCache's own rule, step by step
                ref.put(w, ids)
            assert got.cur == ref.cur and got.old == ref.old
        got.old["moved"] = [1, 2]
        assert miss("moved") == [1, 2] and "moved" in got.cur and "moved" not in got.old
    with pytest.raises(ValueError, match="ASCII"):
        miss("é")


_systems = ["", "Be brief.", "You are a helpful assistant. " * 12, "x<|im_end|>y 12 345"]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(_systems), _messages, st.booleans(),
                          st.sampled_from([1, 4, 16]), st.sampled_from([0, 7, 2**63 + 5])),
                min_size=1, max_size=6))
def test_block_keys_equal_the_hashes_of_the_token_ids(model_dir: str, bpe_dir: str,
                                                      reqs: list) -> None:
    for src in (model_dir, bpe_dir, BUILTIN):
        toks, ref = Tokenizers({"*": src}), Tokenizers({"*": src})
        for system, messages, add_gen, bs, salt in reqs * 2:   # again: prefixes, keys kept
            body = {"model": "m", "messages": [{"role": "system", "content": system},
                                               *messages], "add_generation_prompt": add_gen}
            n, hashes = toks.block_key("chat", body, bs, salt)
            ids = ref.token_ids("chat", body)
            assert n == len(ids)
            assert list(hashes) == list(block_hashes(ids, bs, 0, salt))


def test_a_shared_prefix_is_hashed_once_and_a_request_again_is_a_lookup(model_dir: str) -> None:
    toks = Tokenizers({"*": model_dir})
    tok = toks.get("m")
    sysp = "You are a helpful assistant. " * 12
    def two(q: str) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": sysp},
                                           {"role": "user", "content": q}]}
    keys = {q: toks.block_key("chat", two(q), 16) for q in ("one", "two", "three")}
    assert len(tok.prefixes) == 2          # first: nothing cached yet; then the system turn
    assert not toks.keys and toks.key_misses == 0      # a chat cut into pieces: no request key
    misses = tok.pieces.misses
    for _ in range(3):                     # again: its pieces, then (third time) its whole plan
        n, h = toks.block_key("chat", two("two"), 16)
        assert n == keys["two"][0] and list(h) == list(keys["two"][1])
    assert tok.pieces.misses == misses and len(tok.prefixes) == 3
    assert tuple(tok.prefixes)[-1][2:] == tuple(tok.chat_plan(tok.render_chat(two("two"))))
    comp = {"model": "m", "prompt": "some text " * 10}
    n, h = toks.block_key("completions", comp, 4)
    assert toks.key_misses == 1 and toks.key_hits == 0
    assert toks.block_key("completions", comp, 4)[1] is h and toks.key_hits == 1
    assert n == len(toks.token_ids("completions", comp)) and len(h) == n // 4


def test_the_key_and_prefix_caches_are_bounded_in_size(model_dir: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from motor.coordinator import tokenize
    monkeypatch.setattr(tokenize, "KEYS_MAX_BYTES", 3000)
    monkeypatch.setattr(tokenize, "PREFIXES_MAX_CHARS", 3000)
    toks = Tokenizers({"*": model_dir})
    tok = toks.get("m")
    for k in range(20):
        body = {"model": "m", "messages": [{"role": "system", "content": f"{k} " * 400},
                                           {"role": "user", "content": "q"}]}
        toks.block_key("chat", body, 16)
        toks.block_key("chat", {**body, "messages": [*body["messages"][:1],
                                                     {"role": "user", "content": "r"}]}, 16)
        toks.block_key("completions", {"model": "m", "prompt": f"{k} " * 400}, 16)
    assert 1 <= len(toks.keys) <= 3 and toks.key_bytes <= 3000 + 1000
    assert 1 <= len(tok.prefixes) <= 3 and tok.prefix_chars <= 3000 + 1000
    assert toks.key_bytes == sum(tokenize._key_size(k, v[3]) for k, v in toks.keys.items())


def test_an_explicit_null_flag_is_keyed_as_the_template_reads_it(model_dir: str) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    null, absent = {"messages": msgs, "add_generation_prompt": None}, {"messages": msgs}
    for src in (model_dir, BUILTIN):
        ref = RoutingTokenizer(src)
        want = {id(b): ref.chat_ids(b) for b in (null, absent)}
        assert want[id(null)] != want[id(absent)]          # null: no generation prompt
        for order in ((null, absent), (absent, null)):
            toks = Tokenizers({"*": src})
            for b in order * 2:
                assert toks.token_ids("chat", b) == want[id(b)]
                assert toks.block_key("chat", b, 4)[0] == len(want[id(b)])


def test_block_key_after_warm_is_block_key_alone(model_dir: str, bpe_dir: str) -> None:
    """warm keeps where its plan's first piece not cached is; block_key's plan_key cuts
    there: the same key and the same prefixes kept as without warm (a wrong cut gives the
    same key but keeps another prefix)."""
    sysp = "You are a helpful assistant. " * 4
    turns = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
             {"role": "user", "content": "two"}]

    def body(n: int, **extra: object) -> dict:
        return {"model": "m", "messages": [{"role": "system", "content": sysp}, *turns[:n]],
                **extra}

    # new pieces (the first: all), a new turn, then every piece cached (twice: the third
    # time the whole plan is a prefix), a longer chat, another flag
    for src in (model_dir, bpe_dir):
        _check_warm_then_block_key(src, [body(1), body(3), body(3), body(3), body(2), body(3),
                                         body(3, add_generation_prompt=False)])


def _check_warm_then_block_key(src: str, bodies: list[dict]) -> None:
    warmed, alone = Tokenizers({"*": src}), Tokenizers({"*": src})
    tok = warmed.get("m")
    cuts: list[tuple[int | None, int]] = []
    plan_key = tok.plan_key

    def spy(plan: list, bs: int, salt: int = 0, cut: int | None = None) -> tuple:
        pieces = tok.pieces._d
        first = next((i for i, p in enumerate(plan)
                      if type(p) is str and p not in pieces), len(plan))
        cuts.append((cut, first))
        return plan_key(plan, bs, salt, cut)
    tok.plan_key = spy  # type: ignore[method-assign]
    for b in bodies:
        assert warmed.warm("chat", b) is None           # short: kept for block_key
        n, h = warmed.block_key("chat", b, 4, 7)
        n0, h0 = alone.block_key("chat", b, 4, 7)
        assert n == n0 and list(h) == list(h0)
        assert list(tok.prefixes) == list(alone.get("m").prefixes)
    assert [c for c, _ in cuts] == [f for _, f in cuts]     # warm's cut, and right
    got = [f for _, f in cuts]
    assert got[0] == 1 and 1 < got[1] < got[2] == got[3]    # all new; a new turn; none


def test_block_key_after_warm_sent_pieces_to_the_pool_cuts_again(model_dir: str) -> None:
    toks = Tokenizers({"*": model_dir}, off_loop_min_chars=100)
    alone = Tokenizers({"*": model_dir})           # no warm
    tok = toks.get("m")
    cuts: list[int | None] = []
    plan_key = tok.plan_key

    def spy(plan: list, bs: int, salt: int = 0, cut: int | None = None) -> tuple:
        cuts.append(cut)
        return plan_key(plan, bs, salt, cut)
    tok.plan_key = spy  # type: ignore[method-assign]

    async def run() -> None:
        for q in ("x y z " * 40, "w " * 80):
            b = chat(q)
            fut = toks.warm("chat", b)
            assert fut is not None and toks._rendered is None   # nothing kept: cut again
            await fut
            n, h = toks.block_key("chat", b, 16)
            n0, h0 = alone.block_key("chat", b, 16)
            assert n == n0 and list(h) == list(h0)
            # the pool's pieces landed: the cut is after them all (a cut kept from
            # before the pool would be before the new turn)
            plan = tok.chat_plan(tok.render_chat(b))
            assert tuple(tok.prefixes)[-1][2:] == tuple(plan)
    try:
        asyncio.run(run())
    finally:
        toks.close()
    assert cuts == [None, None]
