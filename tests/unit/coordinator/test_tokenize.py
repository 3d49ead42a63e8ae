"""Routing tokenization equals the engine's: the sim's model directory and ``builtin``."""
from __future__ import annotations

import pytest

from motor.coordinator.tokenize import BUILTIN, RoutingTokenizer, TokenizeError, Tokenizers
from motor.errors import ConfigError
from motor.sim.tokenizer import SimTokenizer, write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_model_dir(tmp_path_factory.mktemp("tok")))


CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief. ünïcödé ✓"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "image_url", "image_url": {"url": "x"}},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "literal <|im_end|> inside"}],
]


@pytest.mark.parametrize("source", ["dir", BUILTIN])
@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_gen", [True, False])
def test_chat_ids_equal_the_sim_engines(model_dir: str, source: str, messages: list,
                                        add_gen: bool) -> None:
    engine = SimTokenizer(model_dir)
    want = engine.encode(engine.render_chat(messages, add_generation_prompt=add_gen))
    tok = RoutingTokenizer(model_dir if source == "dir" else BUILTIN)
    assert tok.chat_ids({"messages": messages, "add_generation_prompt": add_gen}) == want


def test_hi_is_21_tokens_and_generation_prompt_is_default(model_dir: str) -> None:
    tok = RoutingTokenizer(model_dir)
    assert len(tok.chat_ids({"messages": [{"role": "user", "content": "hi"}]})) == 21


@pytest.mark.parametrize("source", ["dir", BUILTIN])
def test_continue_final_message_drops_the_end_marker(model_dir: str, source: str) -> None:
    engine = SimTokenizer(model_dir)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    want = engine.encode(engine.render_chat(msgs, continue_final_message=True))
    tok = RoutingTokenizer(model_dir if source == "dir" else BUILTIN)
    assert tok.chat_ids({"messages": msgs, "continue_final_message": True,
                         "add_generation_prompt": False}) == want


def test_tools_reach_the_template(tmp_path) -> None:
    import json
    import shutil
    d = write_model_dir(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if tools %}TOOLS:{{ tools | map(attribute='name') | join(',') }}\n"
                            "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = RoutingTokenizer(str(d))
    ids = tok.chat_ids({"messages": [{"role": "user", "content": "x"}],
                        "tools": [{"name": "f"}, {"name": "g"}]})
    assert bytes(ids) == b"TOOLS:f,g\nx>"
    shutil.rmtree(d)


@pytest.mark.parametrize("source", ["dir", BUILTIN])
def test_completion_prompt_forms(model_dir: str, source: str) -> None:
    tok = RoutingTokenizer(model_dir if source == "dir" else BUILTIN)
    engine = SimTokenizer(model_dir)
    assert tok.completion_ids({"prompt": "héllo <|endoftext|>"}) == engine.encode("héllo <|endoftext|>")
    assert tok.completion_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.completion_ids({"prompt": ["ab", "cd"]}) == [97, 98]
    assert tok.completion_ids({"prompt": [[1, 2], [3]]}) == [1, 2]
    with pytest.raises(TokenizeError):
        tok.completion_ids({"prompt": {"x": 1}})
    assert tok.completion_ids({"prompt": [0, 2**32 - 1]}) == [0, 2**32 - 1]
    for bad in ([-1], [1, 2**32], [[2**40, 1], [2]]):    # no engine has such ids: not a key
        with pytest.raises(TokenizeError, match=r"prompt token ids are expected to be in "
                                                r"0\.\.4294967295, got -?\d+"):
            tok.completion_ids({"prompt": bad})


def test_bad_messages_raise_tokenize_error() -> None:
    with pytest.raises(TokenizeError):
        RoutingTokenizer(BUILTIN).chat_ids({"messages": "hi"})


def test_missing_directory_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        RoutingTokenizer(str(tmp_path / "nope"))


def test_tokenizers_per_model_with_default(model_dir: str) -> None:
    t = Tokenizers({"a": model_dir})
    assert t.get("a").source == model_dir
    assert t.get("b").source == BUILTIN
    t2 = Tokenizers({"*": model_dir})
    assert t2.get("zzz").source == model_dir
    assert t2.token_ids("completions", {"model": "zzz", "prompt": "ab"}) == [97, 98]


def test_load_all_loads_every_listed_tokenizer_once(model_dir: str) -> None:
    t = Tokenizers({"a": model_dir, "b": model_dir, "c": BUILTIN})
    t.load_all()
    a = t.get("a")
    assert t.get("b") is a and a.source == model_dir     # one load per directory
    assert t.get("c").source == BUILTIN
    t.load_all()
    assert t.get("a") is a                                # loaded ones are kept


def test_load_all_names_the_entry_of_a_bad_directory(model_dir: str, tmp_path) -> None:
    bad = tmp_path / "half"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    (bad / "tokenizer_config.json").write_text("{}")
    for mapping, entry, path in [({"*": str(tmp_path / "nope")}, "'*'", tmp_path / "nope"),
                                 ({"a": model_dir, "m-1": str(bad)}, "'m-1'", bad)]:
        with pytest.raises(ConfigError) as e:
            Tokenizers(mapping).load_all()
        msg = str(e.value)
        assert msg.startswith(f"coordinator.kv.tokenizers[{entry}]: expected `builtin` or a "
                              f"model directory, got '{path}' ("), msg
        assert "tokenizer.json" in msg


def test_a_kv_affinity_worker_loads_its_tokenizers_before_any_request(
        model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from motor.config.schema import ClusterConfig
    from tests.support.gateway import serve_until_listening
    from tests.support.procs import free_ports

    cfg = ClusterConfig.model_validate({"coordinator": {
        "port": free_ports(1)[0], "policy": "kv_affinity",
        "kv": {"tokenizers": {"m": model_dir, "*": BUILTIN}}}})
    with caplog.at_level(logging.INFO, logger="motor.coordinator.tokenize"):
        serve_until_listening(cfg, ["http://127.0.0.1:9"])
    loaded = sorted(r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("routing tokenizer for model"))
    assert loaded == ["routing tokenizer for model *: builtin",
                      f"routing tokenizer for model m: {model_dir}"]


def test_a_kv_router_loads_its_tokenizers_when_made(model_dir: str, tmp_path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # every KV router: kv_affinity's, a PD leg policy's, the joint choice's
    from motor.config.schema import KvRoutingConfig
    from motor.coordinator.kv.router import KvRouter

    r = KvRouter(KvRoutingConfig(tokenizers={"m": model_dir}))
    assert list(r.tokenizers._cache) == [model_dir]
    # a directory gone since the CLI read it: a warning, and requests routed on load alone
    with caplog.at_level("WARNING", logger="motor.coordinator.kv.router"):
        r = KvRouter(KvRoutingConfig(tokenizers={"m": str(tmp_path / "gone")}))
    assert [rec.getMessage().split(":")[0] for rec in caplog.records] == \
        ["coordinator.kv.tokenizers['m']"]
    assert r.request_hashes("completions", {"model": "m", "prompt": "hi"}) is None
