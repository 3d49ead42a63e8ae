"""One command-line voice across every ``motor`` sub-command (conventions in motor/cli.py).

Walks every sub-command of :data:`motor.cli.COMMANDS` (a new one is covered as it is added):
its ``--help``, and a table of bad options, each refused before anything starts with exit
status 2 and ``motor <command>: error: argument <opt>: expected ..., got ...``.
"""
from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

import motor.cli as cli
from motor.cli import COMMANDS, OptionError, apply_overrides
from tests.support.procs import program_stderr

ROOT = Path(__file__).resolve().parents[2]

def _command_param(name: str) -> object:
    return name


def _sub_parser(command: str) -> argparse.ArgumentParser:
    return cli.build_parser(command).commands[command]


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's help as printed (defaults filled in), by its first long name."""
    fmt = parser._get_formatter()
    out = {}
    for a in parser._actions:
        if a.help and a.help is not argparse.SUPPRESS and a.option_strings:
            out[a.option_strings[-1]] = fmt._expand_help(a)
    return out


# ------------------------------------------------------------------ --help


@pytest.mark.parametrize("command", [_command_param(c) for c in COMMANDS])
def test_help_of_every_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: motor {command} ")
    assert not re.search(r"\bNone\b", text), "help says None"
    assert "%(" not in text
    parser = _sub_parser(command)
    helps = _helps(parser)
    for a in parser._actions:
        if not a.option_strings or a.help is argparse.SUPPRESS or a.dest == "help":
            continue
        h = helps[a.option_strings[-1]]
        assert h.count("(default:") <= 1, h
        assert not re.search(r"(?<!\()\bdefault:", h), f"default not as '(default: X)': {h}"
        trivial = a.default in (None, False, "", []) or \
            any(o.startswith("--no-") for o in a.option_strings) and \
            not isinstance(a, argparse.BooleanOptionalAction)
        if not trivial:
            assert "(default: " in h, f"{a.option_strings}: default {a.default!r} not shown"
        if isinstance(a, argparse.BooleanOptionalAction) and a.default is not None:
            assert h.endswith(f"(default: {a.option_strings[0 if a.default else 1]})"), h
        # the shared options: one metavar, one wording
        shared = {"--config": ("FILE", cli.HELP_CONFIG), "--host": ("HOST", cli.HELP_HOST),
                  "--port": ("PORT", cli.HELP_PORT),
                  "--controller": ("URL[,URL...]", cli.HELP_CONTROLLER),
                  "--log-dir": ("DIR", cli.HELP_LOG_DIR)}
        for opt, (metavar, head) in shared.items():
            if opt in a.option_strings:
                assert a.metavar == metavar, (opt, a.metavar)
                assert h.startswith(head), (opt, h)
        if "-c" in a.option_strings:
            assert a.option_strings == ["-c", "--config"] and a.metavar == "FILE"


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: motor [-h] [--log-level LEVEL] [--log-format FORMAT] COMMAND")
    assert "(default: info)" in text and "None" not in text
    for name in COMMANDS:
        assert f"    {name} " in text


def test_help_formatter_shows_real_defaults_once() -> None:
    p = cli.Parser(prog="motor x", formatter_class=cli.HelpFormatter)
    p.add_argument("--a", type=cli.positive_float, default=2.0, help="seconds")
    p.add_argument("--b", default=None, help="from the config (default: x.y of the config)")
    p.add_argument("--c", action=argparse.BooleanOptionalAction, default=False, help="c on")
    p.add_argument("--d", default="50%", help="share")
    p.add_argument("--e", action="store_true", help="flag")
    helps = _helps(p)
    assert helps["--a"] == "seconds (default: 2)"
    assert helps["--b"] == "from the config (default: x.y of the config)"
    assert helps["--no-c"] == "c on (default: --no-c)"
    assert helps["--d"] == "share (default: 50%)"
    assert helps["--e"] == "flag"


# ------------------------------------------------------------------ bad options

_XFAIL: dict[str, str] = {}

# (argv, option as argparse names it, the text after "argument <opt>: "); {file} / {dir}
# stand for an existing file / directory; rows marked main=True are refused by main()
# (after parsing, before anything starts), the others by argparse
BAD = [
    (["coordinator", "--port", "x"], "--port", "expected a port number 1..65535, got 'x'"),
    (["coordinator", "--port", "0"], "--port", "expected a port number 1..65535, got 0"),
    (["coordinator", "--port", "-1"], "--port", "expected a port number 1..65535, got -1"),
    (["coordinator", "--workers", "0"], "--workers", "expected an integer >= 1, got 0"),
    (["coordinator", "--host", "not a host!!"], "--host",
     "expected an IP address or host name, got 'not a host!!'"),
    (["coordinator", "--policy", "fastest"], "--policy",
     "expected one of round_robin, least_load, kv_affinity, got 'fastest'"),
    (["coordinator", "--mode", "pd"], "--mode",
     "expected one of union, pd_prefill_first, pd_decode_first, pd_bootstrap, got 'pd'"),
    (["coordinator", "--backend", "localhost:8001"], "--backend",
     "expected [ROLE=]http(s)://HOST:PORT with ROLE one of union, prefill, decode, "
     "got 'localhost:8001'"),
    (["coordinator", "--kv-events", "http://127.0.0.1:8001"], "--kv-events",
     "expected http://HOST:PORT=[bind:]tcp://HOST:PORT[;replay=ENDPOINT], "
     "got 'http://127.0.0.1:8001'"),
    (["coordinator", "--controller", "127.0.0.1:18500"], "--controller",
     "expected a URL http://HOST:PORT or https://HOST:PORT, got '127.0.0.1:18500'"),
    (["coordinator", "-c", "/nonexistent/motor.yaml"], "-c/--config",
     "expected a config file (YAML or JSON), got '/nonexistent/motor.yaml' (no such file)"),
    (["coordinator", "-c", "{dir}"], "-c/--config",
     "expected a config file (YAML or JSON), got '{dir}' (a directory)"),
    (["controller", "--port", "65536"], "--port", "expected a port number 0..65535, got 65536"),
    (["controller", "--host", "bad_host"], "--host", "expected an IP address or host name, "
                                                     "got 'bad_host'"),
    (["node-manager", "--log-dir", "{file}"], "--log-dir",
     "expected a directory, got '{file}' (a file)"),
    (["node-manager", "--controller", "ftp://127.0.0.1:18500"], "--controller",
     "expected a URL http://HOST:PORT or https://HOST:PORT, got 'ftp://127.0.0.1:18500'"),
    (["node-manager", "--controller", "http://127.0.0.1:1,127.0.0.1:2"], "--controller",
     "expected URLs http://HOST:PORT or https://HOST:PORT, comma-separated, got '127.0.0.1:2' "
     "in 'http://127.0.0.1:1,127.0.0.1:2'"),
    (["node-manager", "--port", "x"], "--port", "expected a port number 0..65535, got 'x'"),
    (["sim", "--max-num-seqs", "0"], "--max-num-seqs", "expected an integer >= 1, got 0"),
    (["sim", "--eos-prob", "1.5"], "--eos-prob", "expected a number in [0, 1], got 1.5"),
    (["sim", "--fault-status", "600"], "--fault-status",
     "expected an HTTP status 100..599, got 600"),
    (["sim", "--time-scale", "-1"], "--time-scale", "expected a number >= 0, got -1"),
    (["sim", "--seed", "x"], "--seed", "expected an integer, got 'x'"),
    (["sim", "--fault", "explode"], "--fault", "expected one of none, "),
    (["sim", "--kv-events-config", "{x"], "--kv-events-config",
     "expected a JSON object, got '{x'"),
    (["bench", "--concurrency", "-3"], "--concurrency", "expected an integer >= 1, got -3"),
    (["bench", "--num-requests", "0"], "--num-requests", "expected an integer >= 1, got 0"),
    (["bench", "--timeout", "0"], "--timeout", "expected a number > 0, got 0"),
    (["bench", "--request-rate", "0"], "--request-rate", "expected a number > 0, got 0"),
    (["bench", "--range-ratio", "1"], "--range-ratio", "expected a number in [0, 1), got 1"),
    (["bench", "--prefix-len", "-1"], "--prefix-len", "expected an integer >= 0, got -1"),
    (["bench", "--json", "/nonexistent/dir/x.json"], "--json",
     "expected a file to write, got '/nonexistent/dir/x.json' (no directory /nonexistent/dir)"),
    (["bench", "--json", "{dir}"], "--json", "expected a file to write, got '{dir}' "
                                             "(a directory)"),
    (["bench", "--url", "127.0.0.1:8000"], "--url",
     "expected a URL http://HOST:PORT or https://HOST:PORT, got '127.0.0.1:8000'"),
    (["bench", "--endpoint", "v1/completions"], "--endpoint",
     "expected an API path starting with / (e.g. /v1/chat/completions), got 'v1/completions'"),
    (["bench", "--extra-body", "[1]"], "--extra-body",
     "expected a JSON object, e.g. '{\"temperature\": 0}', got '[1]'"),
    (["bench", "--dataset", "sharegpt"], "--dataset",
     "expected one of random, shared-prefix, multi-turn, got 'sharegpt'"),
    (["up", "--mode", "big"], "--mode", "expected one of union, pd, got 'big'"),
    (["up", "--ready-timeout", "-1"], "--ready-timeout", "expected a number > 0, got -1"),
    (["up", "--port", "0"], "--port", "expected a port number 1..65535, got 0"),
    (["up", "--log-dir", "{file}"], "--log-dir", "expected a directory, got '{file}' (a file)"),
    (["up", "-c", "/nonexistent/motor.yaml"], "-c/--config",
     "expected a config file (YAML or JSON), got '/nonexistent/motor.yaml' (no such file)"),
    (["demo", "--num-requests", "0"], "--num-requests", "expected an integer >= 1, got 0"),
    (["demo", "--concurrency", "-3"], "--concurrency", "expected an integer >= 1, got -3"),
    (["demo", "--output-len", "0"], "--output-len", "expected an integer >= 1, got 0"),
    (["demo", "--json", "/nonexistent/dir/x.json"], "--json",
     "expected a file to write, got '/nonexistent/dir/x.json' (no directory /nonexistent/dir)"),
    (["demo", "--ready-timeout", "0"], "--ready-timeout", "expected a number > 0, got 0"),
]
# refused by main() after parsing: a check against the config
BAD_MAIN = [
    (["coordinator", "--workers", "65"], "--workers", "expected an integer <= 64, got 65"),
    (["node-manager", "--node", "node9"], "--node",
     "expected one of the config's nodes (node0), got 'node9'"),
]


def _rows(rows: list[tuple[list[str], str, str]], main: bool) -> list[object]:
    out = []
    for argv, opt, message in rows:
        reason = _XFAIL.get(f"{argv[0]} {opt}")
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(argv, opt, message, main, marks=marks,
                                id=" ".join(argv).replace("/", "_")))
    return out


@pytest.mark.parametrize(("argv", "opt", "message", "main"),
                         _rows(BAD, False) + _rows(BAD_MAIN, True))
def test_bad_option_is_one_error_line(argv: list[str], opt: str, message: str, main: bool,
                                      tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    subst = {"{file}": str(file), "{dir}": str(tmp_path)}

    def fill(s: str) -> str:
        for k, v in subst.items():
            s = s.replace(k, v)
        return s

    argv = [fill(a) for a in argv]
    message = fill(message)
    command = argv[0]
    try:
        # argparse alone first: a row argparse accepts never reaches main() (nothing starts)
        cli.build_parser(command).parse_args(argv)
    except SystemExit as e:
        status = e.code
    else:
        assert main, f"{argv} was accepted by argparse"
        status = cli.main(argv)
    cap = capsys.readouterr()
    assert status == 2
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert lines == [f"usage: motor {command} [OPTIONS] ('motor {command} --help' lists them)",
                     lines[-1]], cap.err
    head = f"motor {command}: error: argument {opt}: "
    assert lines[-1].startswith(head + message), lines[-1]
    assert re.fullmatch(r".*: expected .+, got .+", lines[-1])


def test_override_refused_by_a_cross_field_check_names_the_option(
        capsys: pytest.CaptureFixture[str]) -> None:
    # the embedded default config's controller listens on 18500: the coordinator may not
    assert cli.main(["coordinator", "--port", "18500"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: motor coordinator [OPTIONS]")
    assert lines[1].startswith("motor coordinator: error: argument --port: ")
    assert "18500" in lines[1] and "controller.port" in lines[1]


def test_a_global_option_after_the_command_is_explained(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["sim", "--log-level", "debug"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "motor sim: error: unrecognized arguments: --log-level debug (--log-level is global: "
        "motor --log-level LEVEL sim ...)")
    with pytest.raises(SystemExit) as e:
        cli.main(["sim", "--log-format", "json"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "motor sim: error: unrecognized arguments: --log-format json (--log-format is global: "
        "motor --log-format FORMAT sim ...)")


def test_bad_option_in_a_subprocess_has_no_traceback() -> None:
    r = subprocess.run([sys.executable, "-m", "motor", "coordinator", "--port", "x"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert program_stderr(r.stderr).splitlines() == [
        "usage: motor coordinator [OPTIONS] ('motor coordinator --help' lists them)",
        "motor coordinator: error: argument --port: expected a port number 1..65535, got 'x'"]


def test_coordinator_errors_go_to_stderr(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("coordinator: {port: [8000]}\n")
    assert cli.main(["coordinator", "-c", str(bad)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.startswith(f"motor coordinator: invalid config {bad}")
    assert "coordinator.port" in cap.err and "Traceback" not in cap.err


def test_coordinator_busy_port_goes_to_stderr_with_status_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "motor", "coordinator", "--port", str(port),
                            "--backend", "http://127.0.0.1:1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert program_stderr(r.stderr) == (f"motor coordinator: cannot listen on 127.0.0.1:{port} "
                                        "(--port): address already in use")


# ------------------------------------------------------------------ the types


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "::1", "fe80::1%eth0",
                                  "localhost", "node-1.example.com", "example.com.", "a" * 63])
def test_host_name_accepts(host: str) -> None:
    assert cli.host_name(host) == host


@pytest.mark.parametrize("host", ["", "not a host!!", "-bad", "bad-", "a..b", "1.2.3.999",
                                  "a" * 64, "http://x", "[::1]", "under_score", "x:80"])
def test_host_name_refuses(host: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected an IP address or host name"):
        cli.host_name(host)


def test_file_and_directory_types(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    assert cli.output_file("-") == "-"
    assert cli.output_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")
    assert cli.output_file(str(f)) == str(f)
    assert cli.log_directory(str(tmp_path)) == str(tmp_path)
    assert cli.log_directory(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(.*/f is a file\)"):
        cli.log_directory(str(f / "sub"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"no directory .*/nope"):
        cli.output_file(str(tmp_path / "nope" / "x.json"))
    assert cli.config_file(str(f)) == str(f)
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(no such file\)"):
        cli.config_file(str(tmp_path / "missing.yaml"))


def test_urls() -> None:
    for ok in ("http://127.0.0.1:18500", "http://ctl:18500/", "http://[::1]:18500",
               "https://ctl:1"):   # https: a controller with controller.tls
        assert cli.http_url(ok) == ok
    for bad in ("127.0.0.1:18500", "ftp://ctl:1", "http://ctl:0", "http://ctl:x",
                "http://ctl:1/v1", "http://bad host:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.http_url(bad)
    assert cli.base_url("https://api.example.com/v1") == "https://api.example.com/v1"
    with pytest.raises(argparse.ArgumentTypeError):
        cli.base_url("ftp://x")


# ------------------------------------------------------------------ apply_overrides


class _Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int = Field(8000, ge=1, le=65535)
    workers: int = Field(1, ge=1, le=64)
    mode: str = "union"

    @model_validator(mode="after")
    def _one_worker_in_pd(self) -> _Inner:
        if self.mode == "pd" and self.workers > 1:
            raise ValueError(f"inner.workers is expected to be 1 with mode pd, got {self.workers}")
        return self


class _Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inner: _Inner = Field(default_factory=_Inner)
    other: int = 0

    @model_validator(mode="after")
    def _other_below_port(self) -> _Outer:
        if self.other >= self.inner.port:
            raise ValueError("other is expected to be below the port")
        return self


def test_apply_overrides_sets_and_revalidates() -> None:
    cfg = _Outer()
    assert apply_overrides(cfg, {"inner.port": ("--port", None)}) is cfg
    new = apply_overrides(cfg, {"inner.port": ("--port", 9000), "inner.mode": ("--mode", "pd")})
    assert (new.inner.port, new.inner.mode, cfg.inner.port) == (9000, "pd", 8000)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"inner.port": ("--port", 70000)}, "argument --port: expected an integer <= 65535, got 70000"),
    ({"inner.port": ("--port", "x")}, "argument --port: expected a valid integer, unable to "
                                      "parse string as an integer, got 'x'"),
    ({"inner.workers": ("--workers", 2), "inner.mode": ("--mode", "pd")},
     "argument --workers: expected 1 with mode pd, got 2"),
    ({"inner.port": ("--port", 5)}, "argument --port: other is expected to be below the port"),
])
def test_apply_overrides_words_errors_as_argparse(overrides: dict, message: str) -> None:
    cfg = _Outer(other=10)
    with pytest.raises(OptionError) as e:
        apply_overrides(cfg, overrides)
    assert str(e.value) == message


def test_fail_prints_option_errors_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.fail("x", OptionError("--port", "expected 1, got 2")) == 2
    assert cli.fail("x", "cannot listen", 1) == 1
    assert capsys.readouterr().err.splitlines() == [
        "usage: motor x [OPTIONS] ('motor x --help' lists them)",
        "motor x: error: argument --port: expected 1, got 2",
        "motor x: cannot listen"]


def test_a_bad_log_format_variable_is_named_not_a_traceback() -> None:
    """``MOTOR_LOG_FORMAT`` is read before any command runs: a bad one is exit 2 with the
    variable named (it was a traceback)."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "motor", "ctl", "instances"], capture_output=True,
                       env={**os.environ, "MOTOR_LOG_FORMAT": "xml"}, timeout=60)
    assert r.returncode == 2
    assert r.stderr.decode().strip() == ("motor: MOTOR_LOG_FORMAT: expected one of text, json, "
                                         "got 'xml'")


def test_a_bad_start_attempts_variable_stops_the_node_manager() -> None:
    """``MOTOR_ENGINE_START_ATTEMPTS`` that is not an integer >= 1: exit 2 with the variable
    named, nothing started (it used to be ignored, silently removing the give-up limit)."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "motor", "node-manager"], capture_output=True,
                       env={**os.environ, "MOTOR_ENGINE_START_ATTEMPTS": "0"}, timeout=60)
    assert r.returncode == 2
    assert "MOTOR_ENGINE_START_ATTEMPTS: expected an integer >= 1, got '0'" in r.stderr.decode()


def test_coordinator_with_an_unreadable_tokenizer_directory_does_not_start(tmp_path: Path) -> None:
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(f"coordinator: {{policy: kv_affinity, kv: {{tokenizers: "
                   f"{{'*': {tmp_path / 'no-such-model'}}}}}}}\n")
    r = subprocess.run([sys.executable, "-m", "motor", "coordinator", "-c", str(cfg),
                        "--backend", "http://127.0.0.1:1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    lines = program_stderr(r.stderr).splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == (
        f"motor coordinator: coordinator.kv.tokenizers['*']: tokenizer directory "
        f"'{tmp_path / 'no-such-model'}' is expected to hold tokenizer.json and "
        f"tokenizer_config.json: No such file or directory (os error 2)"), lines[0]


def test_tokenizers_are_checked_where_a_kv_router_uses_them(tmp_path: Path) -> None:
    import argparse

    from motor.config.schema import CoordinatorConfig
    from motor.coordinator.tokenize import check_tokenizers
    from motor.errors import ConfigError
    from motor.up import load_for_cli

    gone = {"tokenizers": {"m": str(tmp_path / "gone")}}
    for used in [{"policy": "kv_affinity"},
                 {"mode": "pd_prefill_first", "pd": {"prefill_policy": "kv_affinity"}},
                 {"mode": "pd_bootstrap", "pd": {"decode_policy": "kv_affinity"}},
                 {"mode": "pd_prefill_first", "pd": {"joint": {"enabled": True}}}]:
        with pytest.raises(ConfigError, match=r"^coordinator.kv.tokenizers\['m'\]: "):
            check_tokenizers(CoordinatorConfig.model_validate({**used, "kv": gone}))
    # a config shared with round robin: an entry no KV router reads does not stop it
    for unused in [{"policy": "round_robin"}, {"mode": "pd_prefill_first"}]:
        check_tokenizers(CoordinatorConfig.model_validate({**unused, "kv": gone}))
    # motor up checks them before it starts anything (as the coordinator's TLS and key files)
    cfg = tmp_path / "up.yaml"
    cfg.write_text(f"coordinator: {{policy: kv_affinity, kv: {{tokenizers: "
                   f"{{m: {tmp_path / 'gone'}}}}}}}\nnodes:\n  - name: n0\n    engines: "
                   f"[{{name: sim, kind: sim, model: m, count: 1, base_port: 18950}}]\n")
    with pytest.raises(ConfigError, match=r"^coordinator.kv.tokenizers\['m'\]: tokenizer "
                                          r"directory .* is expected to hold"):
        load_for_cli(argparse.Namespace(config=str(cfg), mode=None, port=None))
