"""A real Prometheus scrapes a `motor up` cluster under load (`-m prometheus`, the prometheus
lane of .ci/run): every metric docs/metrics.md lists as `always` (and, with
`coordinator.policy: kv_affinity`, as `kv_affinity`) has samples from its component's job,
deploy/prometheus/motor-rules.yaml evaluates without errors into the recorded series, no
alert fires on a healthy cluster, every query of deploy/grafana/motor.json returns
data, and the engines' own series come through the controller's /metrics/engines with
their motor_instance label. Needs Debian's `prometheus` package (`prometheus` on PATH); skipped without it unless
MOTOR_REQUIRE_PROMETHEUS=1."""
from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.support import metrics_doc
from tests.support.procs import free_ports, read_line_with

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(300)]

DEPLOY = os.path.join(metrics_doc.ROOT, "deploy")
RULES = os.path.join(DEPLOY, "prometheus", "motor-rules.yaml")
DASHBOARD = os.path.join(DEPLOY, "grafana", "motor.json")
JOBS = {"coordinator": "motor-coordinator", "controller": "motor-controller",
        "engines": "motor-engines", "node_manager": "motor-node"}
#: what the cluster below runs: the rows with these presences must have samples
CHECKED = {"always", "kv_affinity"}
PROMPT = "a shared prefix that fills a few blocks of sixteen tokens in the index, " * 3
WAIT_S = 120.0


def _binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("MOTOR_REQUIRE_PROMETHEUS") == "1":
            pytest.fail("prometheus is not installed (Debian package `prometheus`) and "
                        "MOTOR_REQUIRE_PROMETHEUS=1")
        pytest.skip("prometheus is not installed (Debian package `prometheus`)")
    return path


def _stop(p: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``timeout_s``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        except ProcessLookupError:
            p.wait()


def _get(url: str, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


class _Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict]:
        out = _get(f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert out["status"] == "success", (expr, out)
        return out["data"]["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False


def _complete(gw: int, stream: bool) -> None:
    body = {"model": "motor-sim", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()


def _value(sample: dict) -> float:
    return float(sample["value"][1])


def test_prometheus_scrapes_every_documented_metric_and_evaluates_the_rules(tmp_path):
    prometheus = _binary()
    ctl, gw, nm, pp = free_ports(4)
    base, _ = free_ports(2, consecutive=True)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"""
controller: {{port: {ctl}, heartbeat_interval_s: 0.2}}
coordinator: {{port: {gw}, policy: kv_affinity}}
nodes:
  - name: n0
    mgmt_port: {nm}
    engines:
      - {{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base},
         health_interval_s: 0.2, engine_config: {{time-scale: 0.05}}}}
""")
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [RULES],
        "scrape_configs": [
            {"job_name": JOBS["coordinator"],
             "static_configs": [{"targets": [f"127.0.0.1:{gw}"]}]},
            {"job_name": JOBS["controller"],
             "static_configs": [{"targets": [f"127.0.0.1:{ctl}"]}]},
            {"job_name": JOBS["node_manager"],
             "static_configs": [{"targets": [f"127.0.0.1:{nm}"]}]},
            {"job_name": JOBS["engines"], "metrics_path": "/metrics/engines",
             "static_configs": [{"targets": [f"127.0.0.1:{ctl}"]}]}]}))
    rows = [r for r in metrics_doc.rows() if r.present in CHECKED]
    with open(RULES, encoding="utf-8") as f:
        rule_file = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    records = [r["record"] for r in rule_file if "record" in r]
    with open(DASHBOARD, encoding="utf-8") as f:
        panels = json.load(f)["panels"]
    dash_exprs = [t["expr"].replace("$job", ".*") for p in panels for t in p.get("targets", [])]
    assert rows and records and dash_exprs

    motor = subprocess.Popen([sys.executable, "-m", "motor", "up", "-c", str(cluster),
                              "--log-dir", str(tmp_path / "logs")],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    prom_log = open(tmp_path / "prometheus.log", "wb")
    prom: subprocess.Popen | None = None
    try:
        line = read_line_with(motor, b"motor is up", 60)
        assert b"motor is up" in line, line
        prom = subprocess.Popen([prometheus, f"--config.file={prom_cfg}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{pp}"],
                                stdout=prom_log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        api = _Prom(pp)
        t0 = time.monotonic()
        deadline = t0 + WAIT_S

        def wait_for(what: str, done) -> None:
            """Send a streamed and a whole completion, then ask ``done()``, until it says
            yes (the load keeps the counters moving between scrapes, for the rates)."""
            while True:
                assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                _complete(gw, stream=True)
                _complete(gw, stream=False)
                last = done()
                if last is True:
                    print(f"{what}: {time.monotonic() - t0:.1f} s")
                    return
                assert time.monotonic() < deadline, f"{what}: still {last}"
                time.sleep(0.5)

        while not api.ready():
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready"
            time.sleep(0.2)

        def targets_up():
            up = {s["metric"]["job"]: _value(s) for s in api.query('up{job=~"motor-.*"}')}
            return up == dict.fromkeys(JOBS.values(), 1.0) or f"up = {up}"
        wait_for("every target scraped", targets_up)

        def documented_series():
            missing = [f"{r.series()} ({JOBS[r.component]})" for r in rows
                       if not api.query(f'{r.series()}{{job="{JOBS[r.component]}"}}')]
            return not missing or f"no samples of {missing}"
        wait_for("every always-present metric", documented_series)

        def recorded():
            missing = [name for name in records if not api.query(name)]
            return not missing or f"nothing recorded for {missing}"
        wait_for("every recording rule", recorded)

        def rates_moved():
            hit = api.query("job:motor_coordinator_kv_prefix_hit_ratio:rate5m")
            rate = api.query("job:motor_coordinator_requests:rate1m")
            ok = (hit and not math.isnan(_value(hit[0])) and rate and _value(rate[0]) > 0)
            return bool(ok) or f"hit ratio {hit}, request rate {rate}"
        wait_for("the rates", rates_moved)

        def dashboard():
            empty = [e for e in dash_exprs if not api.query(e)]
            return not empty or f"no data for {empty}"
        wait_for("every dashboard query", dashboard)

        # what the series say about this cluster
        coord = {"__name__": "job:motor_coordinator_request_error_ratio:rate5m",
                 "job": JOBS["coordinator"]}
        answered = api.query('sum(motor_coordinator_requests_total{route="completions", '
                             'status="200"})')
        assert _value(answered[0]) >= 2
        ratio = api.query("job:motor_coordinator_request_error_ratio:rate5m")
        assert [(s["metric"], _value(s)) for s in ratio] == [(coord, 0.0)]
        hit = _value(api.query("job:motor_coordinator_kv_prefix_hit_ratio:rate5m")[0])
        assert 0 < hit <= 1      # the same prompt again and again: its prefix is found
        p50 = _value(api.query("job:motor_coordinator_time_to_first_token_seconds:p50_5m")[0])
        p99 = _value(api.query("job:motor_coordinator_time_to_first_token_seconds:p99_5m")[0])
        assert 0 < p50 <= p99
        for window in ("5m", "30m", "1h", "6h"):
            miss = api.query(f"job:motor_coordinator_ttft_slo_miss_ratio:rate{window}")
            assert len(miss) == 1 and 0 <= _value(miss[0]) <= 1, (window, miss)
        inflight = api.query("job_exported_instance:motor_coordinator_inflight_requests:sum")
        assert {s["metric"]["exported_instance"] for s in inflight} == {"n0/sim/0", "n0/sim/1"}
        assert {s["metric"]["state"]: _value(s) for s in api.query(
            'motor_controller_instances{job="motor-controller"}')}["ready"] == 2
        # the engines' own series, re-exported by the controller with motor_instance
        running = api.query('vllm:num_requests_running{job="motor-engines"}')
        assert sorted((s["metric"]["motor_instance"], s["metric"]["motor_node"],
                       s["metric"]["motor_role"], s["metric"]["dp_rank"]) for s in running) == [
            ("n0/sim/0", "n0", "union", "0"), ("n0/sim/1", "n0", "union", "0")]
        assert {s["metric"]["motor_instance"]: _value(s) for s in api.query(
            'motor_engine_scrape_up{job="motor-engines"}')} == {"n0/sim/0": 1.0, "n0/sim/1": 1.0}
        ttft = api.query('sum by (exported_instance) (motor_coordinator_instance_time_to_first'
                         '_token_seconds_count{job="motor-coordinator"})')
        # one series per instance from the start; kv_affinity sends the same prompt to one
        assert {s["metric"]["exported_instance"] for s in ttft} == {"n0/sim/0", "n0/sim/1"}
        assert sum(_value(s) for s in ttft) >= 2
        healthy = api.query('motor_node_engine_healthy{job="motor-node"}')
        assert sorted((s["metric"]["exported_instance"], _value(s)) for s in healthy) == [
            ("n0/sim/0", 1.0), ("n0/sim/1", 1.0)]

        # every rule evaluated without error; nothing fires on a healthy cluster
        groups = _get(f"{api.base}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert sorted(r["name"] for r in rules) == sorted(r.get("record") or r["alert"]
                                                          for r in rule_file)
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad
        firing = [a for a in _get(f"{api.base}/api/v1/alerts")["data"]["alerts"]
                  if a["state"] == "firing"]
        assert firing == []
    finally:
        if prom is not None:
            _stop(prom)
        prom_log.close()
        _stop(motor)
    assert motor.returncode == 0
