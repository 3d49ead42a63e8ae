"""PNG plots of ``motor bench`` results, drawn from the ``--json`` document (its source).

``motor bench --plot DIR`` writes :data:`RUN_PLOTS` for the run it just made (from
``result.to_dict()``, the document ``--json`` writes); ``motor bench-plot FILE`` draws the same
from a saved file, and ``motor bench-plot A.json B.json ...`` writes :data:`COMPARE_PLOTS`.

matplotlib (the ``plot`` extra) is imported inside the functions that draw, never at import
time, and only with the Agg canvas: no pyplot, no display, no global backend switch.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from motor.bench.config import BenchConfig

#: the files of one run's plots
RUN_PLOTS = ("ttft.png", "itl.png", "e2el.png", "throughput.png")
#: the files of a comparison of several results
COMPARE_PLOTS = ("compare_cdf.png", "compare_stats.png")
#: the error when matplotlib cannot be imported (after ``argument --plot: ``)
MISSING = "expected matplotlib installed (pip install 'motor[plot]'), got it missing"
DEFAULT_DPI = 100
#: the latency metrics of the comparison's bars (ms)
COMPARED = ("TTFT", "TPOT", "ITL", "E2EL")
#: where each distribution's samples are in a request record, and what one sample is
_SAMPLES = {"TTFT": ("ttft_ms", "requests"), "ITL": ("itl_ms", "gaps"),
            "E2EL": ("e2el_ms", "requests")}
_LONG = {"TTFT": "time to first token", "ITL": "inter-token latency",
         "E2EL": "end-to-end latency"}


def have_matplotlib() -> bool:
    """True when matplotlib can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- data (no matplotlib)

@dataclass(frozen=True)
class Throughput:
    """Completions per time bin: ``edges`` (seconds after the run's start, n + 1 of them),
    ``requests_per_s`` and ``tokens_per_s`` (n bins)."""
    bin_s: float
    edges: np.ndarray
    requests_per_s: np.ndarray
    tokens_per_s: np.ndarray


def throughput_bins(requests: Sequence[Mapping[str, Any]], bin_s: float = 1.0) -> Throughput:
    """Successful requests per second and their output tokens per second, in bins of
    ``bin_s`` seconds: bin k holds the requests whose answer ended (``end_s``) in
    ``[k * bin_s, (k + 1) * bin_s)``, each with all its ``output_tokens``.  The bins run from
    the run's start to the last end (the last one may be partly after it); failed requests
    are left out."""
    ok = [r for r in requests if r.get("ok")]
    ends = np.array([float(r["end_s"]) for r in ok], dtype=np.float64)
    tokens = np.array([float(r.get("output_tokens") or 0) for r in ok], dtype=np.float64)
    idx = np.maximum(np.floor(ends / bin_s), 0).astype(np.int64)
    n = int(idx.max()) + 1 if idx.size else 1
    counts = np.bincount(idx, minlength=n).astype(np.float64)
    toks = np.bincount(idx, weights=tokens, minlength=n)
    return Throughput(bin_s, np.arange(n + 1, dtype=np.float64) * bin_s,
                      counts / bin_s, toks / bin_s)


def samples(data: Mapping[str, Any], metric: str) -> np.ndarray:
    """The ms samples of ``metric`` (TTFT, ITL or E2EL) over the successful requests of a
    result document (empty when it has no request records)."""
    key, _what = _SAMPLES[metric]
    out: list[float] = []
    for r in data.get("requests") or ():
        if not r.get("ok"):
            continue
        v = r.get(key)
        if isinstance(v, list):
            out.extend(float(x) for x in v)
        elif v is not None:
            out.append(float(v))
    return np.asarray(out, dtype=np.float64)


def labels_for(paths: Sequence[str]) -> list[str]:
    """One label per result file: its name without ``.json``, or the path as given where
    two files have the same name."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return [s if stems.count(s) == 1 else p for s, p in zip(stems, paths)]


def problem(data: object) -> str | None:
    """Why ``data`` is not a ``motor bench --json`` document (None when it is one)."""
    if not isinstance(data, dict):
        return "not a JSON object"
    missing = [k for k in ("config", "summary", "metrics") if not isinstance(data.get(k), dict)]
    if missing:
        return "no " + ", ".join(missing)
    if not isinstance(data.get("requests", []), list):
        return "requests is not a list"
    return None


def _config(data: Mapping[str, Any]) -> BenchConfig:
    from motor.bench.config import BenchConfig
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    kw = {k: v for k, v in (data.get("config") or {}).items() if k in names and k != "api_key"}
    try:
        return BenchConfig(**kw)
    except TypeError:
        return BenchConfig()


def describe(data: Mapping[str, Any]) -> str:
    """One line naming the run of a result document: target, model, dataset and lengths,
    load, streaming, requests ok / failed and duration."""
    from motor.bench.report import describe_run
    c = _config(data)
    s = data.get("summary") or {}
    lengths = f"input {c.input_len} / output {c.output_len} tokens"
    if c.dataset != "random" and c.prefix_len:
        lengths += f", prefix {c.prefix_len} x {c.num_groups} groups"
    if c.dataset == "multi-turn":
        lengths += f", {c.num_conversations} conversations x {c.turns} turns"
    return (f"{describe_run(c, str(s.get('model', '?')))}  ({lengths});  "
            f"{s.get('requests_completed', 0)} ok / {s.get('requests_failed', 0)} failed "
            f"in {float(s.get('duration_s') or 0):.1f} s")


def _short(data: Mapping[str, Any]) -> str:
    c = _config(data)
    conc = c.effective_concurrency()
    load = (f"{c.request_rate:g} req/s" if c.request_rate else "closed loop") + \
        (f" x{conc}" if conc else "")
    return f"{c.dataset}, {load}, in/out {c.input_len}/{c.output_len}"


# ---------------------------------------------------------------- figures

def _figure(title: str, subtitle: str, nrows: int = 1, ncols: int = 2,
            size: tuple[float, float] = (11.0, 4.4), sharex: bool = False,
            ) -> tuple[Figure, list[Axes]]:
    """A figure on the Agg canvas with a bold title, a grey subtitle (wrapped) and
    ``nrows`` x ``ncols`` axes laid out below them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.layout_engine import ConstrainedLayoutEngine
    sub = "\n".join(textwrap.wrap(subtitle, 150)) or " "
    pt = 1.0 / (72.0 * size[1])  # one point in figure-height units
    title_y = 1.0 - 8 * pt
    sub_y = title_y - 12 * 1.45 * pt
    axes_top = sub_y - (sub.count("\n") + 1) * 8 * 1.3 * pt - 6 * pt
    # the axes are laid out below the two lines of text
    fig = Figure(figsize=size, layout=ConstrainedLayoutEngine(rect=(0.0, 0.0, 1.0, axes_top)))
    FigureCanvasAgg(fig)
    fig.text(0.5, title_y, title, ha="center", va="top", fontsize=12, weight="bold")
    fig.text(0.5, sub_y, sub, ha="center", va="top", fontsize=8, color="0.35")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex)
    return fig, [ax for row in axes for ax in row]


def _no_samples(ax: Axes, why: str) -> None:
    ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="0.4")


def distribution_figure(data: Mapping[str, Any], metric: str) -> Figure:
    """Histogram and CDF of one latency (TTFT, ITL or E2EL, ms) of a result document."""
    v = samples(data, metric)
    what = _SAMPLES[metric][1]
    fig, (hist, cdf) = _figure(f"{metric} ({_LONG[metric]}) distribution", describe(data))
    xlabel = f"{metric} (ms)"
    hist.set(title="histogram", xlabel=xlabel, ylabel=f"{what} (count)")
    cdf.set(title="CDF", xlabel=xlabel, ylabel=f"{what} at or below x (%)", ylim=(0, 101))
    if v.size == 0:
        streamed = bool((data.get("config") or {}).get("stream", True))
        why = "no samples" + ("" if streamed or metric == "E2EL"
                              else f" ({metric} is measured only with --stream)")
        _no_samples(hist, why)
        _no_samples(cdf, why)
        return fig
    hist.hist(v, bins=int(min(60, max(10, np.sqrt(v.size)))), color="C0", alpha=0.85)
    mean = float(v.mean())
    p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
    for x, name, style in ((mean, "mean", "-"), (p50, "P50", "--"), (p99, "P99", ":")):
        hist.axvline(x, color="C3", linestyle=style, linewidth=1.2,
                     label=f"{name} {x:.2f} ms")
    hist.legend(title=f"N = {v.size}", fontsize=8, title_fontsize=8)
    xs = np.sort(v)
    ys = np.arange(1, xs.size + 1) * (100.0 / xs.size)
    cdf.step(xs, ys, where="post", color="C0")
    span = float(xs[-1] - xs[0]) or 1.0
    for q, x in ((50, p50), (90, p90), (99, p99)):
        cdf.plot([x], [q], "o", color="C3", markersize=4)
        right = x - float(xs[0]) > 0.7 * span  # label on the left of points near the edge
        cdf.annotate(f"P{q} {x:.2f}", (x, q), textcoords="offset points",
                     xytext=(-6 if right else 6, -10), ha="right" if right else "left",
                     fontsize=8)
    cdf.grid(alpha=0.3)
    return fig


def throughput_figure(data: Mapping[str, Any], bin_s: float = 1.0) -> Figure:
    """Completed requests/s and output tokens/s over the run (:func:`throughput_bins`), with
    the run's averages from the summary."""
    t = throughput_bins(data.get("requests") or (), bin_s)
    fig, (reqs, toks) = _figure(f"Throughput over time ({bin_s:g} s bins, by when each "
                                "answer ended)", describe(data), nrows=2, ncols=1,
                                size=(11.0, 5.6), sharex=True)
    s = data.get("summary") or {}
    left = t.edges[:-1]
    for ax, y, avg, label, color in (
            (reqs, t.requests_per_s, s.get("request_throughput"), "completed requests/s", "C0"),
            (toks, t.tokens_per_s, s.get("output_token_throughput"), "output tokens/s", "C2")):
        ax.bar(left, y, width=t.bin_s, align="edge", color=color, alpha=0.85,
               edgecolor="white", linewidth=0.5)
        if avg:
            ax.axhline(float(avg), color="C3", linestyle="--", linewidth=1.2,
                       label=f"run average {float(avg):.2f}")
            ax.legend(fontsize=8, loc="upper right")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    if not data.get("requests"):
        _no_samples(reqs, "no request records")
    toks.set_xlabel("time since the run's start (s)")
    return fig


def run_figures(data: Mapping[str, Any]) -> dict[str, Figure]:
    """The figures of one run, by file name (:data:`RUN_PLOTS`)."""
    return {"ttft.png": distribution_figure(data, "TTFT"),
            "itl.png": distribution_figure(data, "ITL"),
            "e2el.png": distribution_figure(data, "E2EL"),
            "throughput.png": throughput_figure(data)}


def compare_cdf_figure(named: Sequence[tuple[str, Mapping[str, Any]]]) -> Figure:
    """Overlaid CDFs of TTFT and ITL, one line per result (label, document)."""
    fig, axes = _figure("TTFT and ITL CDFs",
                        ";  ".join(f"{label}: {_short(d)}" for label, d in named))
    for ax, metric in zip(axes, ("TTFT", "ITL")):
        what = _SAMPLES[metric][1]
        ax.set(title=f"{metric} ({_LONG[metric]})", xlabel=f"{metric} (ms)",
               ylabel=f"{what} at or below x (%)", ylim=(0, 101))
        for i, (label, d) in enumerate(named):
            v = np.sort(samples(d, metric))
            color = f"C{i % 10}"
            if v.size == 0:
                ax.plot([], [], color=color, label=f"{label} (no samples)")
                continue
            ax.step(v, np.arange(1, v.size + 1) * (100.0 / v.size), where="post",
                    color=color, label=f"{label} (P99 {np.percentile(v, 99):.2f} ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    return fig


def compare_stats_figure(named: Sequence[tuple[str, Mapping[str, Any]]]) -> Figure:
    """Bars of the mean and P99 of TTFT, TPOT, ITL and E2EL (the ``metrics`` section), one
    pair per result."""
    fig, axes = _figure("Mean and P99 latency per result",
                        ";  ".join(f"{label}: {_short(d)}" for label, d in named),
                        ncols=len(COMPARED), size=(max(11.0, 2.2 * len(named) * 2), 4.4))
    x = np.arange(len(named), dtype=np.float64)
    w = 0.38
    for ax, metric in zip(axes, COMPARED):
        for k, (stat, color) in enumerate((("average", "C0"), ("p99", "C1"))):
            vals = [((d.get("metrics") or {}).get(metric) or {}).get(stat) for _l, d in named]
            heights = [float(v) if v is not None else 0.0 for v in vals]
            bars = ax.bar(x + (k - 0.5) * w, heights, width=w, color=color,
                          label="mean" if stat == "average" else "P99")
            ax.bar_label(bars, labels=[f"{v:.1f}" if v is not None else "n/a" for v in vals],
                         fontsize=7, padding=1)
        ax.set_xticks(x, [label for label, _d in named], rotation=20 if len(named) > 2 else 0,
                      ha="right" if len(named) > 2 else "center", fontsize=8)
        ax.set(title=metric, ylabel=f"{metric} (ms)")
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def compare_figures(named: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Figure]:
    """The comparison figures of several results (label, document), by file name
    (:data:`COMPARE_PLOTS`)."""
    return {"compare_cdf.png": compare_cdf_figure(named),
            "compare_stats.png": compare_stats_figure(named)}


def save(figures: Mapping[str, Figure], out_dir: str, dpi: int = DEFAULT_DPI) -> list[str]:
    """Write each figure as ``out_dir/<name>`` (the directory created if needed); return the
    paths.  Raises OSError when they cannot be written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=dpi, format="png")
        paths.append(path)
    return paths


def write_run_plots(data: Mapping[str, Any], out_dir: str, dpi: int = DEFAULT_DPI) -> list[str]:
    """:data:`RUN_PLOTS` of one result document into ``out_dir``; the paths written."""
    return save(run_figures(data), out_dir, dpi)


def write_compare_plots(named: Sequence[tuple[str, Mapping[str, Any]]], out_dir: str,
                        dpi: int = DEFAULT_DPI) -> list[str]:
    """:data:`COMPARE_PLOTS` of several (label, document) into ``out_dir``; the paths."""
    return save(compare_figures(named), out_dir, dpi)
