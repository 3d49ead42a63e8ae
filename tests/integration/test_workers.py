"""`coordinator.workers = 2`: two worker processes on one port, metrics summed, a killed worker
is restarted while the other keeps serving."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from tests.support.procs import free_ports, spawn, stop, wait_http

BODY = json.dumps({"model": "motor-sim", "prompt": "hello", "max_tokens": 2}).encode()


def post(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=BODY,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        return r.status


def worker_pid(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/instances", timeout=5) as r:
        return json.loads(r.read())["worker_pid"]


def requests_total(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("motor_coordinator_requests_total{") and 'route="completions"' in ln)


def two_workers(tmp_path) -> tuple[int, list]:
    """A sim and ``motor coordinator --workers 2`` in front of it, both ready: (the
    coordinator's port, the processes: sim, supervisor)."""
    sim, gw = free_ports(2)
    procs = [spawn(["sim", "--port", str(sim), "--time-scale", "0"], str(tmp_path / "sim.log")),
             spawn(["coordinator", "--port", str(gw), "--workers", "2", "--backend",
                    f"http://127.0.0.1:{sim}"], str(tmp_path / "coord.log"))]
    try:
        wait_http(f"http://127.0.0.1:{sim}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
    except BaseException:
        for p in procs:
            stop(p)
        raise
    return gw, procs


def test_two_workers_share_the_port_and_survive_kill9(tmp_path):
    gw, procs = two_workers(tmp_path)
    try:
        # ready means every worker is: whichever answers, both rows are ready
        with urllib.request.urlopen(f"http://127.0.0.1:{gw}/readiness", timeout=5) as r:
            ready = json.loads(r.read())
        assert ready["workers_synced"] == [True, True]
        assert ready["workers_routable"] == [1, 1]
        pids = set()
        deadline = time.monotonic() + 20
        while len(pids) < 2 and time.monotonic() < deadline:
            wait_http(f"http://127.0.0.1:{gw}/readiness")
            pids.add(worker_pid(gw))
        assert len(pids) == 2, "both workers answer on the same port"
        for _ in range(40):
            assert post(gw) == 200
        assert requests_total(gw) == 40  # summed over both workers, whichever answers
        # the latency histograms too (observed from C into the same files, MmapBuckets)
        with urllib.request.urlopen(f"http://127.0.0.1:{gw}/metrics", timeout=5) as r:
            text = r.read().decode()
        counts = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines()
                  if 'route="completions"' in ln and ln.split("{")[0].endswith("_count")}
        assert counts["motor_coordinator_e2e_request_latency_seconds_count"] == 40, counts
        inf = [float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("motor_coordinator_e2e_request_latency_seconds_bucket{")
               and 'le="+Inf"' in ln and 'route="completions"' in ln]
        assert inf == [40]
        # in-flight gauges summed over the live workers (no per-pid series left by a dead one)
        gauges = [ln for ln in text.splitlines()
                  if ln.startswith("motor_coordinator_inflight_requests{")]
        assert gauges and not any("pid=" in ln for ln in gauges), gauges
        assert sum(float(ln.split()[-1]) for ln in gauges) == 0
        victim = pids.pop()
        os.kill(victim, signal.SIGKILL)
        ok = 0
        for _ in range(40):
            try:
                ok += post(gw) == 200
            except OSError:
                pass  # a connection queued on the dead worker's socket may be reset
        assert ok >= 30
        new = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (new - pids - {victim}):
            try:
                new.add(worker_pid(gw))
            except OSError:
                pass
        assert new - pids - {victim}, "the killed worker was replaced by a new process"
        wait_http(f"http://127.0.0.1:{gw}/readiness")   # the new worker published its row
        assert requests_total(gw) >= 40 + ok  # the dead worker's counts are kept
    finally:
        for p in procs:
            stop(p)


def test_sighup_without_tls_or_keys_keeps_every_worker(tmp_path):
    """SIGHUP (reload) to the supervisor of 2 workers with nothing to reload: the workers
    it forwards it to keep running and serving (its default action ended them)."""
    gw, procs = two_workers(tmp_path)
    try:
        assert post(gw) == 200
        os.kill(procs[1].pid, signal.SIGHUP)
        time.sleep(1.0)             # the supervisor polls its workers every 50 ms
        for _ in range(10):
            assert post(gw) == 200
        log = (tmp_path / "coord.log").read_text()
        assert "died" not in log and "restarting" not in log, log
    finally:
        for p in procs:
            stop(p)


# -- the data plane with the feed: KV events, shared load, management API ---------------
SIM = ["--time-scale", "0.02", "--enable-prompt-tokens-details"]
PREFIX = "".join(f"workers share this system prompt, line {i:03d}: be brief.\n" for i in range(24))


class Conn:
    """One keep-alive connection to the gateway, so we know which worker answers it."""

    def __init__(self, port: int) -> None:
        import http.client
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.pid = self.get("/instances")["worker_pid"]

    def get(self, path: str) -> dict:
        self.c.request("GET", path)
        r = self.c.getresponse()
        return json.loads(r.read())

    def complete(self, prompt: str, max_tokens: int = 2) -> tuple[int, dict]:
        self.c.request("POST", "/v1/completions", json.dumps(
            {"model": "motor-sim", "prompt": prompt, "max_tokens": max_tokens}),
            {"content-type": "application/json"})
        r = self.c.getresponse()
        return r.status, json.loads(r.read())

    def close(self) -> None:
        self.c.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def one_conn_per_worker(gw: int, n: int = 2) -> dict[int, Conn]:
    conns: dict[int, Conn] = {}
    deadline = time.monotonic() + 20
    while len(conns) < n and time.monotonic() < deadline:
        c = Conn(gw)
        if c.pid in conns:
            c.close()
        else:
            conns[c.pid] = c
    assert len(conns) == n, "every worker answers on the shared port"
    return conns


def test_feed_kv_events_shared_load_and_kill9(tmp_path):
    import threading
    gw, mgmt, s1, k1, s2, k2 = free_ports(6)
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps({"coordinator": {
        "host": "127.0.0.1", "port": gw, "policy": "kv_affinity", "workers": 2,
        "management_port": mgmt, "feed": {"scrape_interval_s": 0.2}}}))
    procs = [spawn(["sim", "--port", str(s), "--kv-events-endpoint", f"tcp://127.0.0.1:{k}",
                    "--seed", str(i)] + SIM, str(tmp_path / f"sim{i}.log"))
             for i, (s, k) in enumerate(((s1, k1), (s2, k2)))]
    conns: dict[int, Conn] = {}
    try:
        for s in (s1, s2):
            wait_http(f"http://127.0.0.1:{s}/health")
        procs.append(spawn(["coordinator", "-c", str(cfg),
                            "--backend", f"http://127.0.0.1:{s1}", f"http://127.0.0.1:{s2}",
                            "--kv-events", f"http://127.0.0.1:{s1}=tcp://127.0.0.1:{k1}",
                            "--kv-events", f"http://127.0.0.1:{s2}=tcp://127.0.0.1:{k2}"],
                           str(tmp_path / "coord.log")))
        wait_http(f"http://127.0.0.1:{mgmt}/readiness")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        wait_http(f"http://127.0.0.1:{mgmt}/liveness")
        conns = one_conn_per_worker(gw)
        time.sleep(0.5)   # the SUB sockets' subscriptions settle (ZMQ slow joiner)

        # an engine publishes: the prefix is cached on sim 2 (a request sent to it directly)
        req = urllib.request.Request(
            f"http://127.0.0.1:{s2}/v1/completions", data=json.dumps(
                {"model": "motor-sim", "prompt": PREFIX + "warm", "max_tokens": 1}).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
        time.sleep(0.2)   # the bound is 50 ms; 4x slack, then one decision per worker
        for pid, c in conns.items():
            status, out = c.complete(PREFIX + f"question for worker {pid}")
            assert status == 200
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PREFIX) - 16, \
                f"worker {pid} routed to the holder of the prefix"

        # engine figures reach the management API through the feed's scrape
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            inst = get_json(f"http://127.0.0.1:{mgmt}/instances")
            if all(e["engine"] is not None for e in inst["endpoints"]):
                break
            time.sleep(0.1)
        assert all(e["engine"] is not None for e in inst["endpoints"])

        # kill -9 one worker under load; the other worker's clients see no error
        victim, survivor = list(conns)
        errors: list[str] = []
        ok = [0]
        stop_flag = threading.Event()

        def survivor_load() -> None:
            c = conns[survivor]
            while not stop_flag.is_set():
                try:
                    status, _ = c.complete("load " * 50, max_tokens=8)
                    if status != 200:
                        errors.append(str(status))
                    ok[0] += 1
                except Exception as e:  # noqa: BLE001
                    errors.append(repr(e))
                    return

        def victim_load() -> None:
            c = conns[victim]
            while not stop_flag.is_set():
                try:
                    c.complete("victim " * 50, max_tokens=30)
                except Exception:  # noqa: BLE001 - its worker dies under it
                    return

        threads = [threading.Thread(target=survivor_load), threading.Thread(target=victim_load)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        new_pid = None
        while time.monotonic() < deadline and new_pid is None:
            time.sleep(0.2)
            try:
                pid = Conn(gw)
            except OSError:
                continue
            if pid.pid not in conns:
                new_pid = pid.pid
            pid.close()
        stop_flag.set()
        for t in threads:
            t.join(30)
        assert new_pid is not None, "the killed worker was replaced"
        assert ok[0] > 0 and errors == [], f"the surviving worker's client saw {errors[:3]}"

        # every request ended: the load summed over workers is exactly 0 again (the dead
        # worker's row was reset, the others released everything)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            inst = get_json(f"http://127.0.0.1:{mgmt}/instances")
            if all(e["inflight"] == 0 for e in inst["endpoints"]):
                break
            time.sleep(0.1)
        for e in inst["endpoints"]:
            assert (e["inflight"], e["inflight_tokens"], e["inflight_prefill_tokens"],
                    e["inflight_decode_tokens"]) == (0, 0, 0, 0)
        assert all(w["synced"] for w in inst["workers"])
        wait_http(f"http://127.0.0.1:{mgmt}/readiness")
    finally:
        for c in conns.values():
            c.close()
        for p in procs:
            stop(p)
    import glob
    assert not [f for f in glob.glob("/dev/shm/motor-coord-*")
                if f.split("-")[2] == str(procs[-1].pid)], "shared memory unlinked"
