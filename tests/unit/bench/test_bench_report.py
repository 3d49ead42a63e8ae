"""motor bench text table and JSON output."""
from __future__ import annotations

import io
import json

from motor.bench.config import BenchConfig
from motor.bench.report import format_metrics_table, format_table, to_json, write_json
from motor.bench.results import METRICS, BenchResult, RequestResult


def _result(cached=True, failed=False):
    reqs = [RequestResult(i, 0, True, e2el=0.1 * (i + 1), ttft=0.01 * (i + 1), itl=[0.01] * 3,
                          input_tokens=100, output_tokens=4,
                          cached_tokens=25 if cached else None) for i in range(4)]
    if failed:
        reqs.append(RequestResult(9, 0, False, e2el=1.0, reason="http_500",
                                  error="HTTP 500: injected failure"))
    return BenchResult(BenchConfig(url="http://127.0.0.1:1", stream=False), "m1", reqs, 2.0)


def test_metrics_table_rows_and_columns():
    res = _result()
    lines = format_metrics_table(res.metrics).splitlines()
    assert lines[0].split() == ["Metric", "Average", "Min", "Max", "Median", "P75", "P90",
                                "P99", "N"]
    assert set(lines[1]) == {"-"}
    rows = lines[2:]
    labels = ["E2EL (ms)", "TTFT (ms)", "TPOT (ms)", "ITL (ms)", "InputTokens", "OutputTokens",
              "OutputTokenThroughput (tok/s)"]
    assert [r[:len(lab)] for r, lab in zip(rows, labels)] == labels
    assert len(rows) == len(METRICS)
    assert len({len(line) for line in [lines[0], *rows]}) == 1        # right-aligned columns
    e2el = rows[0][len("E2EL (ms)"):].split()
    assert e2el == ["250.00", "100.00", "400.00", "250.00", "325.00", "370.00", "397.00", "4"]
    assert rows[3].split()[-1] == "12"                           # ITL: 4 requests x 3 gaps


def test_empty_metric_shows_dashes():
    res = BenchResult(BenchConfig(), "m", [RequestResult(0, 0, True, e2el=0.2, output_tokens=1)],
                      1.0)
    ttft = format_metrics_table(res.metrics).splitlines()[3]
    assert ttft.split() == ["TTFT", "(ms)", "-", "-", "-", "-", "-", "-", "-", "0"]


def test_format_table_summary_lines():
    text = format_table(_result())
    assert "model=m1" in text and "no-stream" in text
    assert "Requests ok / failed:           4 / 0" in text
    assert "Duration:                       2.00 s" in text
    assert "Request throughput:             2.00 req/s" in text
    assert "Output token throughput:        8.00 tok/s" in text
    assert "Cached-token share:             25.0 %" in text
    assert "Failures" not in text
    text = format_table(_result(cached=False, failed=True))
    assert "Cached-token share" not in text
    assert "Requests ok / failed:           4 / 1" in text
    assert "http_500: 1" in text and "injected failure" in text


def test_json_output():
    res = _result(failed=True)
    d = json.loads(to_json(res))
    assert set(d) == {"config", "summary", "metrics", "requests"}
    assert d["summary"]["requests_completed"] == 4 and d["summary"]["requests_failed"] == 1
    assert d["summary"]["failure_reasons"] == {"http_500": 1}
    assert d["summary"]["cached_token_share"] == 0.25
    assert d["metrics"]["E2EL"]["n"] == 4 and d["metrics"]["E2EL"]["unit"] == "ms"
    assert d["metrics"]["E2EL"]["p99"] == res.metrics["E2EL"].p99
    assert d["metrics"]["TTFT"]["n"] == 4
    assert d["config"]["url"] == "http://127.0.0.1:1"
    # one record per request, in the order of res.requests; times in s (start, end) and ms
    assert [(r["conversation"], r["ok"]) for r in d["requests"]] == \
        [(0, True), (1, True), (2, True), (3, True), (9, False)]
    first, failed = d["requests"][0], d["requests"][-1]
    assert first == {"conversation": 0, "turn": 0, "ok": True, "start_s": 0.0, "end_s": 0.1,
                     "e2el_ms": 100.0, "ttft_ms": 10.0, "itl_ms": [10.0, 10.0, 10.0],
                     "input_tokens": 100, "output_tokens": 4, "cached_tokens": 25,
                     "usage_reported": False, "status": None, "reason": None, "error": None}
    assert (failed["reason"], failed["ttft_ms"], failed["itl_ms"]) == ("http_500", None, [])
    out = io.StringIO()
    write_json(res, "-", stdout=out)
    assert json.loads(out.getvalue()) == d


def test_json_hides_api_key_and_maps_nan_to_null(tmp_path):
    res = BenchResult(BenchConfig(api_key="secret"), "m",
                      [RequestResult(0, 0, True, e2el=0.2, output_tokens=1)], 1.0)
    p = tmp_path / "r.json"
    write_json(res, str(p))
    d = json.loads(p.read_text())
    assert d["config"]["api_key"] == "***"
    assert d["metrics"]["TTFT"]["average"] is None and d["metrics"]["TTFT"]["n"] == 0
