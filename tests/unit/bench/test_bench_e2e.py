"""motor bench end to end against a tiny fake OpenAI server on 127.0.0.1."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket

import pytest
from tests.unit.bench.bench_fake_openai import MODEL, FakeOpenAI, answer_tokens

from motor.bench import BenchConfig, BenchError, format_table, run_bench
from motor.bench import cli as bench_cli


def bench(url: str, **kw) -> BenchResult:  # noqa: F821
    kw.setdefault("input_len", 32)
    kw.setdefault("output_len", 5)
    kw.setdefault("timeout", 20.0)
    return asyncio.run(run_bench(BenchConfig(url=url, **kw)))


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    return bench_cli.main(p.parse_args(argv))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("split", [False, True])
def test_stream_all_ok(endpoint, split):
    with FakeOpenAI(cached=8, split_writes=split) as srv:
        res = bench(srv.url, endpoint=endpoint, num_requests=12, concurrency=3,
                    api_key="k1", ignore_eos=True)
    assert (res.completed, res.failed, res.exit_status) == (12, 0, 0)
    assert res.model == MODEL                        # first of GET /v1/models
    assert len(srv.requests) == 12
    for body, headers in zip(srv.requests, srv.headers):
        assert body["model"] == MODEL and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 5
        assert headers["Authorization"] == "Bearer k1"
        assert ("messages" in body) == endpoint.endswith("chat/completions")
    for r in res.requests:
        assert r.ok and r.usage_reported
        assert r.input_tokens == 32 and r.output_tokens == 5 and r.cached_tokens == 8
        assert r.ttft is not None and 0 < r.ttft <= r.e2el
        assert len(r.itl) == 4                       # 5 content chunks -> 4 gaps
        assert r.tpot is not None
    m = res.metrics
    assert m["TTFT"].n == 12 and m["ITL"].n == 48 and m["TPOT"].n == 12
    assert m["InputTokens"].average == 32 and m["OutputTokens"].max == 5
    assert res.cached_share == pytest.approx(8 / 32)
    assert "Cached-token share:             25.0 %" in format_table(res)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_non_stream(endpoint):
    with FakeOpenAI() as srv:
        res = bench(srv.url, endpoint=endpoint, num_requests=6, stream=False, model="given")
    assert (res.completed, res.failed) == (6, 0)
    assert all(b["model"] == "given" and b["stream"] is False and "stream_options" not in b
               for b in srv.requests)
    assert res.metrics["TTFT"].n == 0 and res.metrics["ITL"].n == 0   # not measured
    assert res.metrics["E2EL"].n == 6 and res.metrics["OutputTokens"].average == 5
    assert res.cached_share is None


def test_stream_without_usage_counts_chunks():
    with FakeOpenAI("nousage") as srv:
        res = bench(srv.url, num_requests=4, output_len=7)
    assert res.completed == 4
    for r in res.requests:
        assert not r.usage_reported
        assert r.output_tokens == 7                  # content chunks, role chunk not counted
        assert r.input_tokens == 32                  # estimate: prompt bytes
        assert len(r.itl) == 6


def test_http_500_counted_and_cli_exit_1(capsys):
    with FakeOpenAI(fail_every=3) as srv:
        res = bench(srv.url, num_requests=9, concurrency=1)
        assert (res.completed, res.failed) == (6, 3)
        assert res.failure_reasons == {"http_500": 3}
        assert res.failure_messages == ["http_500: HTTP 500: injected failure (x3)"]  # grouped
        assert all(r.status == 500 for r in res.requests if not r.ok)
        assert res.exit_status == 1
        assert res.metrics["E2EL"].n == 6

        rc = cli(["--url", srv.url, "--num-requests", "6", "--concurrency", "2",
                  "--input-len", "16", "--output-len", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "Requests ok / failed:           4 / 2" in out
    assert "http_500: 2" in out and "injected failure" in out


@pytest.mark.parametrize("mode,reason", [
    ("sse_error", "stream_error"),
    ("event_error", "stream_error"),
    ("no_done", "no_done"),
    ("malformed", "malformed"),
])
def test_stream_failures(mode, reason):
    with FakeOpenAI(mode) as srv:
        res = bench(srv.url, num_requests=3)
    assert (res.completed, res.failed) == (0, 3)
    assert res.failure_reasons == {reason: 3}
    assert res.exit_status == 1
    assert all(r.ttft is None and r.itl == [] for r in res.requests)


def test_timeout_and_transport_failures():
    with FakeOpenAI("slow", slow_s=3.0) as srv:
        res = bench(srv.url, num_requests=2, timeout=0.2, model="m")
    assert res.failure_reasons == {"timeout": 2}

    res = bench(f"http://127.0.0.1:{free_port()}", num_requests=2, model="m")
    assert res.failure_reasons == {"transport": 2}


def test_unreachable_server_without_model_cannot_start(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BenchError, match="/v1/models"):
        bench(url, num_requests=1)
    assert cli(["--url", url, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"motor bench: GET {url}/v1/models: ") and err.count("\n") == 1


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_multi_turn_sends_turns_in_order_with_answers(endpoint):
    with FakeOpenAI(cached=0) as srv:
        res = bench(srv.url, endpoint=endpoint, dataset="multi-turn", num_conversations=3,
                    turns=4, prefix_len=40, num_groups=2, concurrency=4)
    assert (res.completed, res.failed) == (12, 0)
    chat = endpoint.endswith("chat/completions")
    # group the requests by conversation through their first user text
    convs: dict[str, list[dict]] = {}
    for body in srv.requests:
        if chat:
            first_user = body["messages"][1]["content"]
        else:
            first_user = body["prompt"][40:].split("\n")[0]
        convs.setdefault(first_user, []).append(body)
    assert len(convs) == 3 and all(len(v) == 4 for v in convs.values())
    for bodies in convs.values():
        for k, body in enumerate(bodies):
            if chat:
                msgs = body["messages"]
                assert len(msgs) == 2 + 2 * k          # system + history + new user turn
                assert msgs[0]["role"] == "system" and len(msgs[0]["content"]) == 40
                if k:
                    prev = bodies[k - 1]["messages"]
                    assert msgs[:len(prev)] == prev
                    assert msgs[len(prev)] == {"role": "assistant",
                                               "content": "".join(answer_tokens(bodies[k - 1]))}
            else:
                if k:
                    prev = bodies[k - 1]["prompt"]
                    assert body["prompt"].startswith(prev)
                    assert "".join(answer_tokens(bodies[k - 1])) in body["prompt"]
    assert [r.turn for r in res.requests].count(3) == 3
    assert res.cached_share == 0.0


def test_conversation_sampling_orders():
    """round_robin cycles the conversations; random draws any ready one, reproducibly per
    seed, and still sends every turn of a conversation in order."""
    def order(sampling: str, seed: int) -> list[tuple[int, int]]:
        with FakeOpenAI(cached=0) as srv:
            res = bench(srv.url, dataset="multi-turn", num_conversations=6, turns=5,
                        prefix_len=0, concurrency=1, conversation_sampling=sampling, seed=seed)
        assert (res.completed, res.failed) == (30, 0)
        return [(r.conversation, r.turn) for r in res.requests]  # send order (one in flight)

    rr = order("round_robin", 0)
    assert rr == [(c, t) for t in range(5) for c in range(6)]
    a, b, c = order("random", 0), order("random", 0), order("random", 7)
    assert a == b and a != c
    for o in (a, c):
        assert o != rr and sorted(o) == sorted(rr)
        for conv in range(6):
            assert [t for cv, t in o if cv == conv] == list(range(5))
    with pytest.raises(BenchError, match="conversation_sampling: expected one of round_robin, "
                       "random, got 'shuffle'"):
        BenchConfig(conversation_sampling="shuffle").validate()
    with pytest.raises(BenchError, match="seed: expected an integer >= 0, got -1"):
        BenchConfig(seed=-1).validate()


def test_request_rate_and_num_requests_cap():
    with FakeOpenAI() as srv:
        res = bench(srv.url, num_requests=10, request_rate=200.0, seed=1)
        assert res.completed == 10
        res = bench(srv.url, dataset="multi-turn", num_conversations=4, turns=3,
                    num_requests=5, request_rate=500.0, concurrency=2)
        assert res.completed == 5 and len(srv.requests) == 15


def test_duration_stops_dispatching():
    with FakeOpenAI() as srv:
        res = bench(srv.url, num_requests=50_000, input_len=4, output_len=2, duration=0.3,
                    concurrency=2)
    assert 0 < res.completed < 50_000 and res.failed == 0
    assert len(srv.requests) == res.completed


def test_cli_json_file_and_stdout(tmp_path, capsys):
    path = tmp_path / "out.json"
    with FakeOpenAI(cached=4) as srv:
        rc = cli(["--url", srv.url, "--dataset", "shared-prefix", "--num-requests", "8",
                  "--prefix-len", "64", "--num-groups", "2", "--input-len", "16",
                  "--max-tokens", "3", "--json", str(path), "--no-progress",
                  "--extra-body", '{"temperature": 0}'])
        assert rc == 0
        out = capsys.readouterr().out
        assert "E2EL (ms)" in out and "Requests ok / failed:           8 / 0" in out
        d = json.loads(path.read_text())
        assert d["summary"]["requests_completed"] == 8 and d["metrics"]["TTFT"]["n"] == 8
        assert d["summary"]["cached_token_share"] == pytest.approx(4 / 80)
        assert all(b["temperature"] == 0 and b["max_tokens"] == 3 for b in srv.requests)
        systems = {b["messages"][0]["content"] for b in srv.requests}
        assert len(systems) == 2

        rc = cli(["--url", srv.url, "--num-requests", "2", "--json", "-", "--no-progress"])
        assert rc == 0
        cap = capsys.readouterr()
        assert json.loads(cap.out)["summary"]["requests_completed"] == 2
        assert "E2EL (ms)" in cap.err                   # table moved to stderr


def test_help_mentions_every_option(capsys):
    p = bench_cli.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    text = capsys.readouterr().out
    for opt in ("--url", "--endpoint", "--model", "--api-key", "--dataset", "--num-requests",
                "--input-len", "--output-len", "--max-tokens", "--range-ratio", "--prefix-len",
                "--num-groups", "--num-conversations", "--turns", "--seed", "--concurrency",
                "--request-rate", "--stream", "--no-stream", "--ignore-eos", "--duration",
                "--timeout", "--extra-body", "--progress", "--no-progress", "--json"):
        assert opt in text
    for action in p._actions:
        assert action.help, action.dest


def test_bad_config_rejected():
    with pytest.raises(BenchError, match="concurrency"):
        asyncio.run(run_bench(BenchConfig(concurrency=0)))
    with pytest.raises(BenchError, match="url"):
        asyncio.run(run_bench(BenchConfig(url="127.0.0.1:8000")))
