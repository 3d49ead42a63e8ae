"""``motor bench --plot DIR`` and ``motor bench-plot``: PNGs drawn from the --json document."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from tests.unit.bench.bench_fake_openai import FakeOpenAI

import motor.cli as cli
from motor.bench.config import BenchConfig
from motor.bench.plots import (COMPARE_PLOTS, MISSING, RUN_PLOTS, compare_cdf_figure,
                               compare_stats_figure, labels_for, run_figures, samples,
                               throughput_bins, throughput_figure)
from motor.bench.report import write_json
from motor.bench.results import BenchResult, RequestResult

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[3]
SHORT = ["--input-len", "8", "--output-len", "4", "--no-progress"]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height of a PNG, after checking its signature, IHDR chunk (with CRC) and
    IEND."""
    b = path.read_bytes()
    assert b[:8] == b"\x89PNG\r\n\x1a\n", path
    length, kind = struct.unpack(">I4s", b[8:16])
    assert (length, kind) == (13, b"IHDR")
    assert zlib.crc32(b[12:29]) == struct.unpack(">I", b[29:33])[0]
    assert b[-12:-4] == b"\x00\x00\x00\x00IEND"
    width, height = struct.unpack(">II", b[16:24])
    assert width > 0 and height > 0
    return width, height


def _bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_bench_plot_writes_the_pngs_from_the_json(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "new" / "plots"           # two levels created
    js = tmp_path / "run.json"
    with FakeOpenAI(cached=2) as srv:
        rc = cli.main(["bench", "--url", srv.url, "--num-requests", "12", "--concurrency", "3",
                       *SHORT, "--json", str(js), "--plot", str(out)])
        assert rc == 0, capsys.readouterr().err
        assert len(srv.requests) == 12
    assert f"Plots written to {out}: ttft.png itl.png e2el.png throughput.png" in \
        capsys.readouterr().out
    sizes = {name: png_size(out / name) for name in RUN_PLOTS}
    assert sorted(os.listdir(out)) == sorted(RUN_PLOTS)
    assert sizes["ttft.png"] == (1100, 440) and sizes["throughput.png"] == (1100, 560)

    d = json.loads(js.read_text())
    reqs = d["requests"]
    assert len(reqs) == 12 and all(r["ok"] for r in reqs)
    for r in reqs:                                  # the send / end timestamps of each record
        assert 0 <= r["start_s"] <= r["end_s"] <= d["summary"]["duration_s"]
        assert r["end_s"] - r["start_s"] == pytest.approx(r["e2el_ms"] / 1000, abs=2e-6)
        assert r["output_tokens"] == 4 and len(r["itl_ms"]) == 3
    # the plotted samples are the metrics' samples
    for metric in ("TTFT", "ITL", "E2EL"):
        v = samples(d, metric)
        assert v.size == d["metrics"][metric]["n"]
        assert float(np.max(v)) == pytest.approx(d["metrics"][metric]["max"], abs=1e-3)

    # throughput: the bins add up to the summary and count each record by its end
    t = throughput_bins(reqs)
    assert t.bin_s == 1.0 and t.edges[0] == 0 and len(t.edges) == len(t.requests_per_s) + 1
    assert t.requests_per_s.sum() == d["summary"]["requests_completed"]
    assert t.tokens_per_s.sum() == d["summary"]["total_output_tokens"]
    for k in range(len(t.requests_per_s)):
        in_bin = [r for r in reqs if k <= r["end_s"] < k + 1]
        assert t.requests_per_s[k] == len(in_bin)
        assert t.tokens_per_s[k] == sum(r["output_tokens"] for r in in_bin)
    # ... and the figure plots those bins
    reqs_ax, toks_ax = throughput_figure(d).axes
    assert _bar_heights(reqs_ax) == list(t.requests_per_s)
    assert _bar_heights(toks_ax) == list(t.tokens_per_s)
    assert toks_ax.get_xlabel() == "time since the run's start (s)"
    assert reqs_ax.get_ylabel() == "completed requests/s"

    # the JSON is the source: bench-plot on the file draws the same PNGs, byte for byte
    again = tmp_path / "again"
    assert cli.main(["bench-plot", str(js), "--out", str(again)]) == 0
    assert capsys.readouterr().out.split() == [str(again / n) for n in RUN_PLOTS]
    for name in RUN_PLOTS:
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_throughput_bins_by_end_time() -> None:
    reqs = [{"ok": True, "end_s": 0.2, "output_tokens": 1},
            {"ok": True, "end_s": 0.9, "output_tokens": 2},
            {"ok": True, "end_s": 1.5, "output_tokens": 3},
            {"ok": False, "end_s": 2.5, "output_tokens": None},   # failed: left out
            {"ok": True, "end_s": 3.0, "output_tokens": 4}]
    t = throughput_bins(reqs)
    assert list(t.edges) == [0, 1, 2, 3, 4]
    assert list(t.requests_per_s) == [2, 1, 0, 1]
    assert list(t.tokens_per_s) == [3, 3, 0, 4]
    half = throughput_bins(reqs, bin_s=0.5)           # per second: counts / 0.5
    assert list(half.requests_per_s) == [2, 2, 0, 2, 0, 0, 2]
    assert list(half.tokens_per_s) == [2, 4, 0, 6, 0, 0, 8]
    empty = throughput_bins([])
    assert list(empty.edges) == [0, 1] and list(empty.requests_per_s) == [0]


def _result_file(path: Path, scale: float, stream: bool = True) -> dict:
    reqs = [RequestResult(i, 0, True, start=0.1 * i, e2el=scale * (i + 1),
                          ttft=scale * 0.1 * (i + 1) if stream else None,
                          itl=[scale * 0.01] * 3 if stream else [],
                          input_tokens=10, output_tokens=4) for i in range(5)]
    res = BenchResult(BenchConfig(url="http://127.0.0.1:1", stream=stream), "m", reqs, 2.0)
    write_json(res, str(path))
    return json.loads(path.read_text())


def test_compare_two_result_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fast = _result_file(tmp_path / "fast.json", 0.1)
    slow = _result_file(tmp_path / "slow.json", 0.3)
    out = tmp_path / "cmp"
    assert cli.main(["bench-plot", str(tmp_path / "fast.json"), str(tmp_path / "slow.json"),
                     "--out", str(out), "--dpi", "50"]) == 0
    assert capsys.readouterr().out.split() == [str(out / n) for n in COMPARE_PLOTS]
    assert png_size(out / "compare_cdf.png") == (550, 220)
    assert png_size(out / "compare_stats.png")[1] == 220

    named = [("fast", fast), ("slow", slow)]
    ttft_ax, itl_ax = compare_cdf_figure(named).axes
    assert [line.get_label() for line in ttft_ax.get_lines()] == [
        f"fast (P99 {fast['metrics']['TTFT']['p99']:.2f} ms)",
        f"slow (P99 {slow['metrics']['TTFT']['p99']:.2f} ms)"]
    for line, d in zip(ttft_ax.get_lines(), (fast, slow)):   # the CDF of each file's TTFTs
        assert list(line.get_xdata()) == sorted(samples(d, "TTFT"))
        assert line.get_ydata()[-1] == 100
    assert itl_ax.get_xlabel() == "ITL (ms)"
    axes = compare_stats_figure(named).axes
    assert [ax.get_title() for ax in axes] == ["TTFT", "TPOT", "ITL", "E2EL"]
    e2el = axes[3]
    assert [t.get_text() for t in e2el.get_xticklabels()] == ["fast", "slow"]
    assert _bar_heights(e2el) == pytest.approx([   # mean of both files, then P99 of both
        fast["metrics"]["E2EL"]["average"], slow["metrics"]["E2EL"]["average"],
        fast["metrics"]["E2EL"]["p99"], slow["metrics"]["E2EL"]["p99"]])


def test_labels_from_file_names() -> None:
    assert labels_for(["a/x.json", "b/y.json"]) == ["x", "y"]
    assert labels_for(["a/r.json", "b/r.json", "c.json"]) == ["a/r.json", "b/r.json", "c"]


def test_old_json_and_non_streamed_runs_still_plot(tmp_path: Path) -> None:
    d = _result_file(tmp_path / "ns.json", 0.2, stream=False)
    old = {k: d[k] for k in ("config", "summary", "metrics")}     # before the request records
    (tmp_path / "old.json").write_text(json.dumps(old))
    figs = run_figures(d)
    texts = [t.get_text() for ax in figs["ttft.png"].axes for t in ax.texts]
    assert texts == ["no samples (TTFT is measured only with --stream)"] * 2
    assert figs["e2el.png"].axes[0].patches                    # E2EL is measured
    out = tmp_path / "out"
    assert cli.main(["bench-plot", str(tmp_path / "old.json"), "--out", str(out)]) == 0
    assert all(png_size(out / n) for n in RUN_PLOTS)
    assert cli.main(["bench-plot", str(tmp_path / "old.json"), str(tmp_path / "ns.json"),
                     "--out", str(out)]) == 0
    assert all(png_size(out / n) for n in COMPARE_PLOTS)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    command = argv[0]
    assert lines[0] == f"usage: motor {command} [OPTIONS] ('motor {command} --help' lists them)"
    assert len(lines) == 2
    return lines[1]


def test_bad_plot_paths_are_refused_before_the_run(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    with FakeOpenAI() as srv:
        for bad, why in ((f, "a file"), (f / "sub", f"{f} is a file"), ("", "empty")):
            line = _refused(["bench", "--url", srv.url, "--num-requests", "2", *SHORT,
                             "--plot", str(bad)], capsys)
            assert line == (f"motor bench: error: argument --plot: expected a directory to "
                            f"write, got '{bad}' ({why})")
        assert srv.requests == []           # nothing was sent
    assert sorted(os.listdir(tmp_path)) == ["a-file"]


def test_missing_matplotlib_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "r.json"
    _result_file(d, 0.1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib fails
    with FakeOpenAI() as srv:
        line = _refused(["bench", "--url", srv.url, "--num-requests", "2", *SHORT,
                         "--plot", str(tmp_path / "p")], capsys)
        assert srv.requests == []
    assert line == f"motor bench: error: argument --plot: {MISSING}"
    assert line.endswith("expected matplotlib installed (pip install 'motor[plot]'), "
                         "got it missing")
    assert cli.main(["bench-plot", str(d), "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err == f"motor bench-plot: error: {MISSING}\n"
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("content", "why"), [
    (None, "no such file"), ("{x", "not JSON"), ("[1]", "not a JSON object"),
    ('{"config": {}, "summary": {}}', "no metrics"),
])
def test_bench_plot_refuses_what_is_not_a_result(content: str | None, why: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    line = _refused(["bench-plot", str(path), "--out", str(tmp_path / "o")], capsys)
    assert line == (f"motor bench-plot: error: argument FILE: expected a 'motor bench --json' "
                    f"result file, got '{path}' ({why})")
    assert not (tmp_path / "o").exists()


def test_bench_plot_refuses_a_bad_out_and_dpi(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "r.json"
    _result_file(d, 0.1)
    assert _refused(["bench-plot", str(d), "--out", str(d)], capsys) == (
        f"motor bench-plot: error: argument --out: expected a directory to write, got "
        f"'{d}' (a file)")
    assert _refused(["bench-plot", str(d), "--dpi", "0"], capsys) == (
        "motor bench-plot: error: argument --dpi: expected an integer >= 1, got 0")


def test_matplotlib_is_imported_only_to_plot() -> None:
    code = """
import contextlib, io, sys
import motor.cli as c
for argv in (["--help"], ["bench", "--help"], ["bench-plot", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        c.main(argv)
with contextlib.redirect_stdout(io.StringIO()):
    rc = c.main(["bench", "--url", sys.argv[1], "--num-requests", "2", "--input-len", "4",
                 "--output-len", "2", "--no-progress"])
print(rc, "matplotlib" in sys.modules, "motor.bench.plots" in sys.modules)
"""
    with FakeOpenAI() as srv:
        r = subprocess.run([sys.executable, "-c", code, srv.url], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert len(srv.requests) == 2
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "False", "False"]
