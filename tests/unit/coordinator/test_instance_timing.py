"""Per-instance TTFT / TPOT at the coordinator (motor.coordinator.metrics.instance_timing):
observed on the union request path for the instance that answered, exposed like
prometheus-client's histograms, dropped with the instance."""
from __future__ import annotations

import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from motor.config.schema import Role
from motor.coordinator import metrics
from motor.sim.engine import EngineConfig
from motor.sim.options import SimOptions
from motor.sim.server import SimServer
from tests.support.gateway import Gateway, http, run_async


def _counts(instance: str) -> dict[str, float]:
    """{"ttft_count", "ttft_sum", "tpot_count", "tpot_sum"} of ``instance`` (role union)."""
    out = dict.fromkeys(("ttft_count", "ttft_sum", "tpot_count", "tpot_sum"), 0.0)
    for fam in text_string_to_metric_families(metrics.render_metrics().decode()):
        short = {"motor_coordinator_instance_time_to_first_token_seconds": "ttft",
                 "motor_coordinator_instance_time_per_output_token_seconds": "tpot"}.get(fam.name)
        if short is None:
            continue
        for s in fam.samples:
            if s.labels.get("instance") == instance and s.labels.get("role") == "union":
                for suffix in ("count", "sum"):
                    if s.name.endswith("_" + suffix):
                        out[f"{short}_{suffix}"] = s.value
    return out


@run_async
async def test_a_stream_and_a_whole_answer_are_timed_on_the_instance_that_answered(tmp_path):
    sim = SimServer(SimOptions(host="127.0.0.1", port=0, model_dir=str(tmp_path / "tok"),
                               engine=EngineConfig(time_scale=0.2)))
    port = await sim.start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", port)]).start()
    try:
        (ep,) = gw.table.endpoints.values()
        before = _counts(ep.instance_id)
        req = {"model": "motor-sim", "max_tokens": 12,
               "messages": [{"role": "user", "content": "tell me a story"}]}
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions",
                                orjson.dumps({**req, "stream": True}))
        assert st == 200 and out.endswith(b"data: [DONE]\n\n")
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(req))
        assert st == 200
        after = _counts(ep.instance_id)
        assert after["ttft_count"] - before["ttft_count"] == 2
        assert after["ttft_sum"] > before["ttft_sum"]
        assert after["tpot_count"] - before["tpot_count"] == 1     # the stream only
        tpot = after["tpot_sum"] - before["tpot_sum"]
        assert 0 < tpot < 1.0
    finally:
        await gw.stop()
        await sim.stop(drain_timeout_s=0.2)


def test_the_loop_histogram_reads_like_prometheus_clients():
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    buckets = (0.01, 0.1, 1.0)
    a = metrics.LoopHistogram("h_seconds", "help", ["instance", "role"], buckets, reg_a)
    b = Histogram("h_seconds", "help", ["instance", "role"], buckets=buckets, registry=reg_b)
    for v in (0.0, 0.01, 0.05, 0.1, 0.5, 2.0, 100.0):
        a.labels("x", "union").observe(v)
        b.labels("x", "union").observe(v)

    def samples(reg: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
        return [(s.name, s.labels, s.value)
                for f in text_string_to_metric_families(generate_latest(reg).decode())
                for s in f.samples if not s.name.endswith("_created")]
    assert samples(reg_a) == samples(reg_b)
    a.remove("x", "union")
    assert samples(reg_a) == []


def test_an_instance_that_leaves_takes_its_series_along():
    t = metrics.instance_timing("gone/0", Role.DECODE)
    assert metrics.instance_timing("gone/0", Role.DECODE) is t
    t.ttft.observe(0.2)
    assert 'instance="gone/0"' in metrics.render_metrics().decode()
    metrics.forget_instance("gone/0")
    metrics.forget_instance("gone/0")   # twice: a no-op
    assert 'instance="gone/0"' not in metrics.render_metrics().decode()
