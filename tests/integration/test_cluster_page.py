"""The live cluster page (``GET /cluster`` on the controller) in a real headless Chromium
(`-m browser`, the browser lane: .ci/browser.sh): ``motor up`` with two ``motor sim``
engines on 127.0.0.1 under a small load through its coordinator; the page shows both
instances ready with
their engines' figures, then, after a kill -9 of one engine, that instance unhealthy and
ready again, without a reload. A screenshot is saved (``$MOTOR_ARTIFACTS_DIR``, else the
test's tmp dir).

Needs Debian's ``chromium`` and ``chromium-driver`` and selenium (the ``test`` extra);
skipped without them unless MOTOR_REQUIRE_BROWSER=1.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.procs import free_ports, stop

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: launch flags that work in a container as root, offline
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,800")
IDS = ["n1/sim/0", "n1/sim/1"]


def _browser() -> Any:
    """selenium's webdriver module, or a skip (a failure with MOTOR_REQUIRE_BROWSER=1)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip, the test extra)")
        webdriver = None
    if missing:
        why = (f"no headless browser: {', '.join(missing)} missing (Debian packages chromium, "
               f"chromium-driver)")
        if os.environ.get("MOTOR_REQUIRE_BROWSER") == "1":
            pytest.fail(why + " and MOTOR_REQUIRE_BROWSER=1")
        pytest.skip(why)
    return webdriver


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _wait(pred: Any, what: str, timeout_s: float = 60.0) -> None:
    """Until ``pred()`` is True (anything else, or an exception, is shown on timeout)."""
    end = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < end:
        try:
            last = pred()
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            last = e
        if last is True:
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {last}")


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "motor", *args], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _rows(driver: Any) -> dict[str, dict[str, str]]:
    """What the page shows now: {instance id: {"state", "running", "waiting", "kv"}}."""
    return driver.execute_script("""
        const out = {};
        for (const tr of document.querySelectorAll("tr[data-instance]")) {
          const cell = (c) => tr.querySelector('[data-col="' + c + '"]').textContent;
          out[tr.dataset.instance] = {state: tr.dataset.state, running: cell("running"),
                                      waiting: cell("waiting"), kv: cell("kv")};
        }
        return out;""")


class Load:
    """A thread sending small completions through the coordinator (so the page has request
    rates, TTFT and prefix hits to show); errors are ignored."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = json.dumps({"model": "motor-sim", "prompt": "the same prefix, again " * 8,
                           "max_tokens": 4}).encode()
        while not self.stop.is_set():
            for port in self.ports:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                             data=body,
                                             headers={"content-type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=5) as r:
                        r.read()
                    self.sent += 1
                except (urllib.error.URLError, OSError, http.client.HTTPException):
                    pass
            self.stop.wait(0.1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def test_the_page_follows_an_engine_killed_and_restarted_without_a_reload(tmp_path):
    webdriver = _browser()
    from selenium.webdriver.chrome.service import Service

    cport, mport, gw = free_ports(3)
    base = free_ports(2, consecutive=True)[0]
    cfg = {
        "controller": {"host": "127.0.0.1", "port": cport, "heartbeat_interval_s": 0.2,
                       "heartbeat_timeout_s": 2.0, "remove_after_s": 30.0,
                       "watch_timeout_s": 20},
        "coordinator": {"host": "127.0.0.1", "port": gw},
        "nodes": [{"name": "n1", "mgmt_port": mport, "log_dir": str(tmp_path / "logs"),
                   "engines": [{"name": "sim", "kind": "sim", "model": "motor-sim",
                                "count": 2, "base_port": base, "health_interval_s": 0.1,
                                "stop_timeout_s": 3,
                                "engine_config": {"time-scale": 0.05},
                                "restart": {"backoff_initial_s": 0.2,
                                            "backoff_max_s": 1.0}}]}]}
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cfg))
    curl = f"http://127.0.0.1:{cport}"
    up = _spawn(["up", "-c", str(cfile), "--log-dir", str(tmp_path / "up-logs")],
                tmp_path / "up.log")
    driver: Any = None
    load: Load | None = None
    shots = Path(os.environ.get("MOTOR_ARTIFACTS_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    try:
        _wait(lambda: _get(curl + "/health")["status"] == "ok", "the controller", 90)
        _wait(lambda: sorted(i["id"] for i in _get(curl + "/v1/instances")["instances"]
                             if i["state"] == "ready") == IDS, "both instances ready", 90)
        _wait(lambda: bool(_get(f"http://127.0.0.1:{gw}/v1/models")["data"]),
              "the coordinator serving", 60)

        load = Load([gw])
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in FLAGS:
            opts.add_argument(flag)
        opts.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
        driver = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
        driver.set_page_load_timeout(30)
        driver.get(curl + "/cluster")
        # a reload would drop this
        driver.execute_script("window.__motorSamePage = 'yes';")

        def shows_ready_with_figures():
            rows = _rows(driver)
            ok = sorted(rows) == IDS and all(
                r["state"] == "ready" and r["running"] != "-" and r["kv"].endswith("%")
                for r in rows.values())
            return ok or f"page rows {rows}"
        _wait(shows_ready_with_figures, "the page showing both ready with engine figures")
        _wait(lambda: driver.execute_script(
            "return document.querySelector('#spark b').textContent") not in ("-", "0.0")
            or "no request rate yet", "the page showing a request rate")
        leader = driver.find_element("id", "leader").text
        assert leader.startswith(curl) and "(this one)" in leader
        assert driver.find_element("id", "version").text == driver.execute_script(
            "return document.body.dataset.version")
        driver.save_screenshot(str(shots / "cluster-page-ready.png"))

        # kill -9 one engine (its pid from the node manager's management API)
        status = _get(f"http://127.0.0.1:{mport}/v1/instances")
        pids = {i["id"]: i["processes"][0]["pid"] for i in status["instances"]}
        # the page records every state it shows, so a short one is not missed
        driver.execute_script("""
            window.__seen = [];
            const note = () => {
              const tr = document.querySelector('tr[data-instance="n1/sim/0"]');
              const s = tr ? tr.dataset.state : null;
              if (s && window.__seen[window.__seen.length - 1] !== s) window.__seen.push(s);
            };
            new MutationObserver(note).observe(document.getElementById("nodes"),
                                               {subtree: true, childList: true,
                                                attributes: true});
            note();""")
        os.kill(pids["n1/sim/0"], signal.SIGKILL)
        _wait(lambda: "unhealthy" in driver.execute_script("return window.__seen")
              or f"seen {driver.execute_script('return window.__seen')}",
              "the page showing n1/sim/0 unhealthy")
        driver.save_screenshot(str(shots / "cluster-page-unhealthy.png"))
        _wait(lambda: driver.execute_script("return window.__seen")[-1:] == ["ready"]
              or f"seen {driver.execute_script('return window.__seen')}",
              "the page showing n1/sim/0 ready again")
        _wait(shows_ready_with_figures, "both ready with figures again")
        seen = driver.execute_script("return window.__seen")
        assert seen[0] == "ready" and "unhealthy" in seen and seen[-1] == "ready", seen
        assert driver.execute_script("return window.__motorSamePage") == "yes"
        assert _rows(driver)["n1/sim/1"]["state"] == "ready"
        _wait(lambda: driver.execute_script("return S.history.length") >= 3,
              "three points of the request-rate sparkline", 20)
        driver.save_screenshot(str(shots / "cluster-page.png"))
        assert (shots / "cluster-page.png").stat().st_size > 10_000

        # the coordinator's view: both endpoints routable, the table version it applied
        driver.get(f"http://127.0.0.1:{gw}/cluster")

        def coordinator_routes_both():
            got = driver.execute_script("""
                const out = {};
                for (const tr of document.querySelectorAll("tr[data-endpoint]"))
                  out[tr.dataset.endpoint] = tr.dataset.routable;
                return out;""")
            return got == {f"{i}#0": "true" for i in IDS} or f"rows {got}"
        _wait(coordinator_routes_both, "the coordinator's page routing to both endpoints")
        assert driver.execute_script("return document.body.dataset.version") == str(
            _get(f"http://127.0.0.1:{gw}/instances")["version"])
        driver.save_screenshot(str(shots / "coordinator-page.png"))
    finally:
        if load is not None:
            load.close()
        if driver is not None:
            driver.quit()
        stop(up, 30)
    assert up.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert load is not None and load.sent > 0
