"""Benchmarks of kv_affinity's routing key (``motor.coordinator.tokenize``): token ids of a
chat request, first seen (template rendered, text encoded) and seen again (the LRU), with
the ``tokenizers`` model directory ``motor sim`` writes and with ``builtin``.

Budget (issue 13): kv_affinity within 1.3x of round robin's CPU per request on 1 KB chat
prompts: a request seen again must cost a lookup (a few us), not a render and an encode
(``token_ids``: its id LRU; ``block_key`` of a chat cut into pieces: its plan's prefix entry
from the third time on).

Run::

    .venv/bin/python -m pytest bench/bench_tokenize.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
from __future__ import annotations

import itertools
import json

import pytest

from motor.coordinator.tokenize import BUILTIN, Tokenizers
from motor.sim.tokenizer import write_model_dir

pytestmark = pytest.mark.routing

_SYSTEM = "You are a helpful assistant. " * 36       # ~1 KB shared system prompt


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"dir": str(write_model_dir(tmp_path_factory.mktemp("tok"))), "builtin": BUILTIN}


def _chat(n: int) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": _SYSTEM},
                                       {"role": "user", "content": f"question {n}: why?"}]}


@pytest.mark.parametrize("seen", ["first", "again"])
@pytest.mark.parametrize("source", ["dir", "builtin"])
def test_chat_key(benchmark, sources, source, seen):
    benchmark.group = f"tokenize.chat_ids[prompt=1KB,{source}]"
    toks = Tokenizers({"*": sources[source]})
    if seen == "again":
        body = _chat(0)
        toks.token_ids("chat", body)
        ids = benchmark(toks.token_ids, "chat", body)
    else:
        n = itertools.count()
        ids = benchmark(lambda: toks.token_ids("chat", _chat(next(n))))
    assert len(ids) > 200


_HARNESS_SYSTEM = "You are a helpful assistant. Answer concisely and accurately. " * 16


@pytest.mark.parametrize("source", ["dir", "builtin"])
def test_block_key_new_user_turn(benchmark, sources, source):
    """The peer harness's case: a shared ~1 KB system prompt and a new ~110-character user
    turn each request (its ids, the tokens' block hashes; the system prompt's pieces and
    hash-chain state cached)."""
    benchmark.group = f"tokenize.block_key[system=1KB,new user turn,{source}]"
    toks = Tokenizers({"*": sources[source]})
    n = itertools.count()

    def body() -> dict:
        return {"model": "m", "messages": [
            {"role": "system", "content": _HARNESS_SYSTEM},
            {"role": "user", "content": f"Question 1-{next(n)}: please summarise the following "
                                        "text about routers and gateways in two sentences."}]}
    toks.block_key("chat", body(), 16)
    count, hashes = benchmark(lambda: toks.block_key("chat", body(), 16))
    assert count > 1000 and len(hashes) == count // 16


@pytest.mark.parametrize("path", ["splice_plan", "render_split"])
def test_chat_plan(benchmark, sources, path):
    """A chat's plan (its text cut at the added tokens): from the splice's segments
    (``plan_chat``, ``motor._fast.splice``) against the spliced render and its split."""
    benchmark.group = "tokenize.chat_plan[system=1KB,new user turn]"
    tok = Tokenizers({"*": sources["dir"]}).get("m")
    n = itertools.count()

    def body() -> dict:
        return {"model": "m", "messages": [
            {"role": "system", "content": _HARNESS_SYSTEM},
            {"role": "user", "content": f"Question 1-{next(n)}: please summarise."}]}
    if path == "splice_plan":
        text, plan = benchmark(lambda: tok.plan_chat(body()))
        assert text is None
    else:
        plan = benchmark(lambda: tok.chat_plan(tok.render_chat(body())))
    assert plan is not None and plan[0] == 257 and len(plan) == 10


def test_block_key_chat_seen_again(benchmark, sources):
    """The same chat again (a retry, a PD fallback): its whole plan is a prefix entry."""
    benchmark.group = "tokenize.block_key[system=1KB,seen again]"
    toks = Tokenizers({"*": sources["dir"]})
    body = _chat(0)
    for _ in range(2):
        toks.block_key("chat", body, 16)
    count, hashes = benchmark(toks.block_key, "chat", body, 16)
    assert len(hashes) == count // 16 and len(toks.get("m").prefixes) == 2


@pytest.fixture(scope="module")
def trained_bpe() -> dict:
    """The ``model`` of a byte-level BPE with merges (trained here on English-like text;
    the sim's has none), for the new-word benchmark."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = [_HARNESS_SYSTEM + f" Question {i}: please summarise the following text about "
            "routers, gateways, schedulers and caches in two sentences." for i in range(200)]
    tk.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return json.loads(tk.to_str())["model"]


@pytest.mark.parametrize("impl", ["compiled", "library"])
def test_new_word(benchmark, trained_bpe, impl):
    """A word the word cache has not seen (what every new user turn has a few of): its ids
    from the compiled merges (``motor._fast.bpe``) against the library's model (a
    ``tokenize`` call and its ``Token`` objects), through the word cache's miss."""
    from tokenizers import Tokenizer, models

    from motor._fast.bpe import ByteLevelBpe
    from motor._fast.pretok import ByteLevelMiss
    from motor.coordinator.tokenize import WordCache
    benchmark.group = "tokenize.new_word[bpe with merges]"
    m = trained_bpe
    model = Tokenizer(models.BPE(m["vocab"], [tuple(x) for x in m["merges"]])).model
    bpe = ByteLevelBpe(m["vocab"], m["merges"]) if impl == "compiled" else None
    miss = ByteLevelMiss(WordCache(), model, bpe)
    n = itertools.count()
    ids = benchmark(lambda: miss(f" gateways{next(n)}"))
    assert ids and all(isinstance(i, int) for i in ids)
