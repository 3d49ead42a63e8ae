"""``motor bench`` options checked before the run: the OpenAI SDK's base_url form of --url,
--json in a directory that does not exist."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.unit.bench.bench_fake_openai import MODEL, FakeOpenAI

import motor.cli as cli
from motor.bench import BenchConfig


@pytest.mark.parametrize(("url", "endpoint", "target", "models"), [
    ("http://h:8000", "/v1/chat/completions", "http://h:8000/v1/chat/completions",
     "http://h:8000/v1/models"),
    ("http://h:8000/v1", "/v1/chat/completions", "http://h:8000/v1/chat/completions",
     "http://h:8000/v1/models"),
    ("http://h:8000/v1/", "/v1/completions", "http://h:8000/v1/completions",
     "http://h:8000/v1/models"),
    ("https://h/api/v1", "/v1/completions", "https://h/api/v1/completions",
     "https://h/api/v1/models"),
    # an endpoint without /v1 after a base URL with it: the URL as given
    ("http://h/v1", "/completions", "http://h/v1/completions", "http://h/v1/models"),
    ("http://h/v1x", "/v1/completions", "http://h/v1x/v1/completions", "http://h/v1x/v1/models"),
])
def test_base_url_with_or_without_v1(url: str, endpoint: str, target: str, models: str) -> None:
    c = BenchConfig(url=url, endpoint=endpoint)
    assert (c.target_url, c.models_url) == (target, models)


def test_sdk_base_url_form_reaches_the_server(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAI() as srv:  # serves /v1/models and /v1/chat/completions only
        rc = cli.main(["bench", "--url", srv.url + "/v1", "--num-requests", "3",
                       "--input-len", "8", "--output-len", "2", "--no-progress",
                       "--json", "-"])
        assert rc == 0, capsys.readouterr().err
        assert len(srv.requests) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["requests_completed"] == 3
    assert all(b["model"] == MODEL for b in srv.requests)


def test_json_path_is_checked_before_the_run(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with FakeOpenAI() as srv:
        for bad, why in ((tmp_path / "no" / "x.json", f"no directory {tmp_path / 'no'}"),
                         (tmp_path, "a directory")):
            with pytest.raises(SystemExit) as e:
                cli.main(["bench", "--url", srv.url, "--num-requests", "2", "--json", str(bad)])
            assert e.value.code == 2
            assert capsys.readouterr().err.splitlines()[-1] == (
                f"motor bench: error: argument --json: expected a file to write, got "
                f"'{bad}' ({why})")
        assert srv.requests == []  # nothing was sent
        good = tmp_path / "out.json"
        assert cli.main(["bench", "--url", srv.url, "--num-requests", "2", "--input-len", "4",
                         "--output-len", "2", "--no-progress", "--json", str(good)]) == 0
    assert json.loads(good.read_text())["summary"]["requests_completed"] == 2
