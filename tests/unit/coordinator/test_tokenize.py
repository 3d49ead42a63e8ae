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


def broken_template_dir(model_dir: str, dest) -> str:
    """A copy of ``model_dir`` whose chat template is not valid jinja2."""
    import json
    import shutil
    shutil.copytree(model_dir, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }"
    cfg_path.write_text(json.dumps(cfg))
    return str(dest)


def test_load_all_names_each_entry_that_fails_and_keeps_the_others(model_dir: str,
                                                                   tmp_path) -> None:
    half = tmp_path / "half"
    half.mkdir()
    (half / "tokenizer.json").write_text("{not json")
    (half / "tokenizer_config.json").write_text("{}")
    tmpl = broken_template_dir(model_dir, tmp_path / "tmpl")
    # malformed past the files' reading (helper-13): a list for a config, a number for a
    # template; each one clear error, not the AttributeError / TypeError of a step after
    import json
    import shutil
    shutil.copytree(model_dir, tmp_path / "list")
    (tmp_path / "list" / "tokenizer_config.json").write_text("[]")
    shutil.copytree(model_dir, tmp_path / "five")
    cfg = json.loads((tmp_path / "five" / "tokenizer_config.json").read_text())
    (tmp_path / "five" / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "chat_template": 5}))
    t = Tokenizers({"*": str(tmp_path / "nope"), "m-1": str(half), "ok": model_dir,
                    "t": tmpl, "l": str(tmp_path / "list"), "n": str(tmp_path / "five")})
    with pytest.raises(ConfigError) as e:
        t.load_all()
    errors = str(e.value).split("; ")
    assert [m.split(": ", 1)[0] for m in errors] == [
        "coordinator.kv.tokenizers['*']", "coordinator.kv.tokenizers['m-1']",
        "coordinator.kv.tokenizers['t']", "coordinator.kv.tokenizers['l']",
        "coordinator.kv.tokenizers['n']"]
    for m, d, got in [(errors[3], tmp_path / "list", "AttributeError: "),
                      (errors[4], tmp_path / "five", "TypeError: ")]:
        assert m.split(": ", 1)[1].startswith(
            f"tokenizer directory '{d}': tokenizer_config.json or its chat template is not "
            f"what a model directory holds: {got}"), m
    assert errors[0].endswith(f"tokenizer directory '{tmp_path / 'nope'}' is expected to hold "
                              f"tokenizer.json and tokenizer_config.json: No such file or "
                              f"directory (os error 2)"), errors[0]
    assert f"tokenizer directory '{half}' is expected to hold tokenizer.json" in errors[1]
    assert errors[2] == (f"coordinator.kv.tokenizers['t']: tokenizer directory '{tmpl}': its "
                         f"chat template is expected to be a valid jinja2 template, got an "
                         f"error at line 1: unexpected '}}'"), errors[2]
    assert t.get("ok").source == model_dir      # loaded although others failed


def test_a_broken_chat_template_is_routed_on_load_alone(model_dir: str, tmp_path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    # found after start (a worker restarted after the file changed): a warning, no 500
    from motor.config.schema import KvRoutingConfig
    from motor.coordinator.kv.router import KvRouter

    tmpl = broken_template_dir(model_dir, tmp_path / "tmpl")
    import shutil
    shutil.copytree(model_dir, tmp_path / "list")
    (tmp_path / "list" / "tokenizer_config.json").write_text("[]")
    with caplog.at_level("WARNING"):
        r = KvRouter(KvRoutingConfig(tokenizers={"m": tmpl, "l": str(tmp_path / "list")}))
        for model in ("m", "l"):
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            assert r.request_hashes("chat", body) is None
            assert r.request_hashes("chat", body) is None
    assert "chat template is expected to be a valid jinja2 template" in caplog.text
    assert "AttributeError" in caplog.text


def test_a_source_that_failed_is_not_read_again(tmp_path, model_dir: str) -> None:
    gone = tmp_path / "later"
    t = Tokenizers({"m": str(gone)})
    with pytest.raises(ValueError, match="is expected to hold tokenizer.json") as first:
        t.get("m")
    write_model_dir(gone)      # the files appear: still the first error until a restart
    with pytest.raises(ValueError) as again:
        t.get("m")
    assert str(again.value) == str(first.value)


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
