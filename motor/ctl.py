"""``motor ctl``: the operator's command line of the controller's API.

::

    motor ctl instances                      # the instance table (state, node, endpoints)
    motor ctl nodes                          # the registered nodes
    motor ctl drain node0/sim/0              # no new requests, in-flight ones finish, stop
    motor ctl stop node0/sim/0               # stop now
    motor ctl start node0/sim/0              # start a stopped instance
    motor ctl restart node0/sim/0            # drain, stop, start; --no-drain: stop at once
    motor ctl restart --rolling --coordinator http://127.0.0.1:8000
                                             # every instance, one at a time, least hot first

Every subcommand takes ``--output table|json`` (aligned columns on stdout by default; json
prints the controller's documents), ``--controller URL`` (repeatable, or comma-separated;
default ``controller.peers`` of the config, else ``controller.host:port``) and ``-c FILE``.
A follower controller's ``307`` is followed to the leader; a controller that cannot be
reached, or answers 503 without knowing a leader, makes ``motor ctl`` try the next one, and
the whole list again for up to :data:`LEADERLESS_RETRY_S` (an election under way). With
``controller.tls`` every URL is ``https://`` and ``motor ctl`` presents the control plane's
certificate (:mod:`motor.control_tls`), as a node manager does.

``drain`` waits until the instance is ``stopped``, ``restart`` until it is ``ready`` again,
polling ``GET /v1/instances`` (``--no-wait``: return once the controller accepted).
``restart --rolling`` restarts every instance that is not stopped or draining, one at a time,
each ``ready`` again before the next, in the order of :func:`rolling_order`: least hot first,
by the KV-index blocks the coordinators (``--coordinator URL``, their ``GET /instances``) hold
for it, so the instances whose caches serve the most are restarted last, after the cold
ones are warm again.

Exit status: 0 done; 1 the controller refused (its error is printed), could not be reached,
or an instance did not reach the state waited for in time; 2 bad options or config.
"""
from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from motor.cli import (HELP_CONTROLLER, HelpFormatter, Parser, add_config_option, fail,
                       http_url, non_negative_float, positive_float)
from motor.errors import ConfigError

#: seconds ``motor ctl`` keeps trying the controller list while none answers (no leader yet)
LEADERLESS_RETRY_S = 10.0
#: redirects followed for one request
MAX_REDIRECTS = 3
#: timeout of one request to a controller or a coordinator (seconds)
REQUEST_TIMEOUT_S = 10.0
#: longest hold of one long poll of ``GET /v1/instances`` while waiting (seconds)
POLL_HOLD_S = 2.0
#: a restarted instance that is still ``ready`` this long after the controller accepted the
#: restart, never seen otherwise, counts as restarted (the whole restart fell between polls)
RESTART_UNSEEN_S = 10.0
#: extra seconds of the default wait beyond ``--timeout``: drain (the stop), restart (the start)
DRAIN_WAIT_MARGIN_S = 60.0
RESTART_WAIT_MARGIN_S = 900.0

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CtlError(Exception):
    """A failure at run time (exit status 1): the message is printed after ``motor ctl: ``."""


class Refused(CtlError):
    """The controller answered an error: ``status`` and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the controller refused ({status}): {message}")
        self.status = status
        self.message = message


# ---------------------------------------------------------------- HTTP

@dataclass(frozen=True)
class Target:
    """One server: scheme, host, port."""
    https: bool
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Target:
        """``http(s)://HOST[:PORT][/...]`` -> Target.

        Raises
        ------
        ConfigError
            not an http(s) URL with a host.
        """
        bad = ConfigError(f"expected a URL http://HOST:PORT or https://HOST:PORT, got {url!r}")
        try:
            u = urlsplit(url)
            port = u.port
        except ValueError:
            raise bad from None
        if u.scheme not in ("http", "https") or not u.hostname:
            raise bad
        https = u.scheme == "https"
        return cls(https, u.hostname, port or (443 if https else 80))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.https else 'http'}://{host}:{self.port}"


def _request(t: Target, method: str, path: str, body: bytes | None, timeout_s: float,
             tls: ssl.SSLContext | None) -> tuple[int, dict[str, str], bytes]:
    """One request on a new connection: (status, headers lower-cased, body).

    Raises
    ------
    OSError, http.client.HTTPException
        no connection, reset, no answer in time, not an HTTP answer.
    """
    conn: http.client.HTTPConnection
    if t.https:
        conn = http.client.HTTPSConnection(t.host, t.port, timeout=timeout_s,
                                           context=tls or ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(t.host, t.port, timeout=timeout_s)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, data
    finally:
        conn.close()


def _doc(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return None


def _error_message(raw: bytes) -> str:
    doc = _doc(raw)
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return str(doc["error"].get("message", doc["error"]))
    return raw[:300].decode("utf-8", "replace").strip() or "(no body)"


class ControllerClient:
    """Blocking client of the controllers' API: the leader among ``urls``.

    A ``307`` is followed (``Location``, else the body's ``leader``) up to
    :data:`MAX_REDIRECTS` times; a connection error, or a ``503`` whose body says
    ``"leader": null``, moves on to the next URL; when every URL failed, the list is tried
    again every 0.2 s for up to ``retry_s`` seconds. The controller that answered is asked
    first next time.

    Parameters
    ----------
    urls : list of str
        ``http://HOST:PORT`` (``https://`` with ``tls``).
    tls : ssl.SSLContext or None
        The client context of ``controller.tls`` (:func:`motor.control_tls.client_context`).

    Raises
    ------
    ConfigError
        no URL, or one that is not an http(s) URL.
    """

    def __init__(self, urls: Sequence[str], tls: ssl.SSLContext | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S, retry_s: float | None = None) -> None:
        if not urls:
            raise ConfigError("--controller: expected at least one controller URL, got none")
        self.targets = [Target.of(u) for u in urls]
        self.tls = tls
        self.timeout_s = timeout_s
        self.retry_s = LEADERLESS_RETRY_S if retry_s is None else retry_s
        self.current = self.targets[0]

    def request(self, method: str, path: str, body: Any = None,
                timeout_s: float | None = None) -> tuple[int, Any]:
        """``(status, JSON document or None)`` of the leader's answer (any status but a
        redirect or a leaderless 503).

        Raises
        ------
        CtlError
            no controller answered (each one's failure is named).
        """
        data = None if body is None else json.dumps(body).encode()
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + self.retry_s
        while True:
            tried: list[str] = []
            order = [self.current] + [t for t in self.targets if t != self.current]
            for first in order:
                t, hops = first, 0
                while True:
                    try:
                        status, headers, raw = _request(t, method, path, data, timeout, self.tls)
                    except (OSError, http.client.HTTPException) as e:
                        tried.append(f"{t}: {_describe(e)}")
                        break
                    doc = _doc(raw)
                    leader = doc.get("leader", "") if isinstance(doc, dict) else ""
                    if status == 307 and hops < MAX_REDIRECTS:
                        nxt = headers.get("location") or (
                            leader + path if isinstance(leader, str) and leader else "")
                        if nxt:
                            try:
                                t = Target.of(nxt)
                            except ConfigError:
                                tried.append(f"{t}: redirect to {nxt!r}, not a URL")
                                break
                            hops += 1
                            continue
                    if status == 503 and isinstance(doc, dict) and "leader" in doc and \
                            not leader:
                        tried.append(f"{t}: no leader elected yet")
                        break
                    self.current = t
                    return status, doc if doc is not None else _error_message(raw)
            if time.monotonic() >= deadline:
                raise CtlError("no controller answered: " + "; ".join(tried))
            time.sleep(0.2)

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        """The document of ``GET path``; raises :class:`Refused` for an error status."""
        status, doc = self.request("GET", path, timeout_s=timeout_s)
        if status == 404 and path.split("?")[0] in ("/v1/instances", "/v1/nodes"):
            raise Refused(status, f"{_message(doc)}; {self.current} does not look like a motor "
                                  f"controller (every controller serves GET {path}; a "
                                  f"coordinator's view is GET /instances)")
        if status != 200:
            raise Refused(status, _message(doc))
        return doc

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        """``POST path``; returns (status, document) of a 2xx answer, raises
        :class:`Refused` otherwise."""
        status, doc = self.request("POST", path, body)
        if not 200 <= status < 300:
            raise Refused(status, _message(doc))
        return status, doc


def _message(doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return str(doc["error"].get("message", doc["error"]))
    return doc if isinstance(doc, str) else json.dumps(doc)


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer in time"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------- output

def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Aligned columns (two spaces apart, the last one not padded); None prints as ``-``."""
    cells = [[("-" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = []
    for r in [list(headers)] + cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def instances_table(doc: dict[str, Any]) -> str:
    rows = []
    for i in doc.get("instances", []):
        eps = ",".join(f"{e.get('host')}:{e.get('port')}" for e in i.get("endpoints", []))
        rows.append([i.get("id"), i.get("node"), i.get("role"), i.get("engine"), i.get("model"),
                     i.get("state"), eps, i.get("reason")])
    return table(["INSTANCE", "NODE", "ROLE", "ENGINE", "MODEL", "STATE", "ENDPOINTS", "REASON"],
                 rows)


def nodes_table(doc: dict[str, Any]) -> str:
    rows = []
    for n in doc.get("nodes", []):
        age = n.get("last_heartbeat_age_s")
        rows.append([n.get("node"), n.get("host"), n.get("mgmt_port"),
                     None if age is None else f"{float(age):.1f}",
                     ",".join(n.get("instances", []))])
    return table(["NODE", "HOST", "MGMT_PORT", "HEARTBEAT_AGE_S", "INSTANCES"], rows)


def _print(args: argparse.Namespace, doc: Any, text: Callable[[], str]) -> None:
    if args.output == "json":
        print(json.dumps(doc, indent=2), flush=True)
    else:
        print(text(), flush=True)


def _say(msg: str) -> None:
    print(f"motor ctl: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- waiting

def instance_state(doc: dict[str, Any], instance_id: str) -> str | None:
    """The state of ``instance_id`` in an instance table, None when it is not there."""
    for i in doc.get("instances", []):
        if i.get("id") == instance_id:
            return str(i.get("state"))
    return None


def wait_for(client: ControllerClient, instance_id: str, done: Callable[[str, float], bool],
             timeout_s: float, what: str) -> tuple[str, float]:
    """Follow the instance table (long polls of ``GET /v1/instances``) until
    ``done(state, seconds since the call)`` holds; returns (state, seconds).

    Raises
    ------
    CtlError
        the instance left the table, or ``timeout_s`` passed (the last state is named).
    """
    t0 = time.monotonic()
    after: int | None = None
    state = None
    while True:
        waited = time.monotonic() - t0
        left = timeout_s - waited
        hold = max(0.0, min(POLL_HOLD_S, left))
        q = "" if after is None else f"?after={after}&timeout={hold:g}"
        doc = client.get(f"/v1/instances{q}", timeout_s=hold + REQUEST_TIMEOUT_S)
        after = doc.get("version") if isinstance(doc.get("version"), int) else None
        state = instance_state(doc, instance_id)
        waited = time.monotonic() - t0
        if state is None:
            raise CtlError(f"instance {instance_id} left the instance table while waiting for "
                           f"it to be {what}")
        if done(state, waited):
            return state, waited
        if waited >= timeout_s:
            raise CtlError(f"instance {instance_id} is not {what} after {timeout_s:g} s "
                           f"(state {state})")


def _restarted() -> Callable[[str, float], bool]:
    """``done`` of a restart: ``ready`` after having been seen in another state (or still
    ``ready`` after :data:`RESTART_UNSEEN_S`)."""
    seen = {"down": False}

    def done(state: str, waited: float) -> bool:
        if state != "ready":
            seen["down"] = True
            return False
        return seen["down"] or waited >= RESTART_UNSEEN_S
    return done


# ---------------------------------------------------------------- hotness

def coordinator_hotness(urls: Sequence[str], tls: ssl.SSLContext | None = None
                        ) -> tuple[dict[str, int], list[str]]:
    """(instance id -> KV-index blocks held for it, summed over its endpoints and over the
    coordinators that answered; the failures of the others) from each coordinator's
    ``GET /instances`` (``kv_blocks`` of each endpoint; null without ``kv_affinity`` counts
    0). A coordinator with several workers answers on its management port (the feed's
    ``/instances``) with the same field."""
    hot: dict[str, int] = {}
    failed: list[str] = []
    for url in urls:
        t = Target.of(url)
        try:
            status, _, raw = _request(t, "GET", "/instances", None, REQUEST_TIMEOUT_S, tls)
        except (OSError, http.client.HTTPException) as e:
            failed.append(f"{t}: {_describe(e)}")
            continue
        doc = _doc(raw)
        if status != 200 or not isinstance(doc, dict):
            failed.append(f"{t}: GET /instances answered {status}")
            continue
        for ep in doc.get("endpoints", []):
            inst = ep.get("instance") or str(ep.get("key", "")).rpartition("#")[0]
            blocks = ep.get("kv_blocks")
            if inst and isinstance(blocks, int):   # null: the coordinator keeps no KV index
                hot[inst] = hot.get(inst, 0) + blocks
    return hot, failed


def rolling_order(instances: Iterable[str], hot: dict[str, int]) -> list[str]:
    """Least hot first (fewest KV-index blocks), ties by instance id."""
    return sorted(instances, key=lambda i: (hot.get(i, 0), i))


# ---------------------------------------------------------------- commands

def _path(instance_id: str, action: str) -> str:
    return f"/v1/instances/{quote(instance_id, safe='/')}/{action}"


def _drain_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"timeout_s": args.timeout}
    if args.grace is not None:
        body["grace_s"] = args.grace
    return body


def _answer_state(doc: Any) -> str | None:
    return str(doc["state"]) if isinstance(doc, dict) and "state" in doc else None


def _action_row(instance_id: str, action: str, state: str | None, waited: float | None
                ) -> list[object]:
    return [instance_id, action, state, None if waited is None else f"{waited:.1f}"]


ACTION_HEADERS = ["INSTANCE", "ACTION", "STATE", "WAITED_S"]


def _act(client: ControllerClient, args: argparse.Namespace, action: str, instance_id: str,
         body: dict[str, Any], wait: bool) -> dict[str, Any]:
    """POST one action, and wait for its end state when ``wait``; the result document."""
    _, doc = client.post(_path(instance_id, action), body)
    out: dict[str, Any] = {"instance": instance_id, "action": action,
                           "state": _answer_state(doc), "answer": doc}
    if not wait:
        return out
    if action == "drain":
        limit = args.wait_timeout or (args.timeout + DRAIN_WAIT_MARGIN_S)
        _say(f"{instance_id}: draining; waiting for it to be stopped (up to {limit:g} s)")
        state, waited = wait_for(client, instance_id, lambda s, _w: s == "stopped", limit,
                                 "stopped")
    else:
        limit = args.wait_timeout or (args.timeout + RESTART_WAIT_MARGIN_S)
        _say(f"{instance_id}: restarting; waiting for it to be ready again (up to {limit:g} s)")
        state, waited = wait_for(client, instance_id, _restarted(), limit, "ready")
    out.update(state=state, waited_s=round(waited, 3))
    return out


def cmd_instances(client: ControllerClient, args: argparse.Namespace) -> int:
    doc = client.get("/v1/instances")
    _print(args, doc, lambda: instances_table(doc))
    return EXIT_OK


def cmd_nodes(client: ControllerClient, args: argparse.Namespace) -> int:
    doc = client.get("/v1/nodes")
    _print(args, doc, lambda: nodes_table(doc))
    return EXIT_OK


def cmd_action(client: ControllerClient, args: argparse.Namespace) -> int:
    action = args.ctl_command
    if action == "restart" and args.rolling:
        return cmd_rolling(client, args)
    if action == "restart" and args.id is None:
        raise ConfigError("argument ID: expected an instance id (or --rolling), got none")
    body: dict[str, Any] = {}
    if action in ("drain", "restart"):
        body = _drain_body(args)
    if action == "restart":
        body["drain"] = args.drain
    wait = action in ("drain", "restart") and args.wait
    out = _act(client, args, action, args.id, body, wait)
    _print(args, out, lambda: table(ACTION_HEADERS, [_action_row(
        out["instance"], action, out["state"], out.get("waited_s"))]))
    return EXIT_OK


def cmd_rolling(client: ControllerClient, args: argparse.Namespace) -> int:
    if args.id is not None:
        raise ConfigError("argument ID: expected no instance id with --rolling (it restarts "
                          f"them all), got {args.id!r}")
    if not args.wait:   # the next instance restarts only once the last one is ready again
        raise ConfigError("--no-wait: a rolling restart waits for each instance to be ready "
                          "before the next (else every instance would drain at once); "
                          "expected --wait with --rolling, got --no-wait")
    doc = client.get("/v1/instances")
    ids = [i["id"] for i in doc.get("instances", [])
           if i.get("state") not in ("stopped", "draining", "removed")]
    hot: dict[str, int] = {}
    if args.coordinator:
        hot, failed = coordinator_hotness(args.coordinator)
        for f in failed:
            _say(f"coordinator {f}: left out of the hotness figures")
        if len(failed) == len(args.coordinator):
            _say("no coordinator answered: restarting in instance id order")
    order = rolling_order(ids, hot)
    _say(f"rolling restart of {len(order)} instance(s), least hot first: {', '.join(order)}")
    results: list[dict[str, Any]] = []
    body = _drain_body(args) | {"drain": args.drain}
    try:
        for iid in order:
            r = _act(client, args, "restart", iid, body, True)
            r["kv_blocks"] = hot.get(iid)   # None: no coordinator gave a figure
            results.append(r)
            if args.output == "table":
                _say(f"{iid}: {r['state']}"
                     + (f" after {r['waited_s']:.1f} s" if "waited_s" in r else ""))
    finally:
        _print(args, {"order": order, "results": results}, lambda: table(
            ["INSTANCE", "KV_BLOCKS", "STATE", "WAITED_S"],
            [[r["instance"], "-" if r["kv_blocks"] is None else r["kv_blocks"], r["state"],
              None if r.get("waited_s") is None else f"{r['waited_s']:.1f}"]
             for r in results]))
    return EXIT_OK


COMMANDS: dict[str, tuple[Callable[[ControllerClient, argparse.Namespace], int], str]] = {
    "instances": (cmd_instances, "the instance table: id, node, role, state, endpoints"),
    "nodes": (cmd_nodes, "the registered nodes and their last heartbeat"),
    "drain": (cmd_action, "stop routing to an instance, let its requests finish, then stop it; "
                          "waits until it is stopped"),
    "stop": (cmd_action, "stop an instance now (its requests in flight are cut)"),
    "start": (cmd_action, "start a stopped instance"),
    "restart": (cmd_action, "drain (or with --no-drain stop) and start an instance again, or "
                            "every one in turn with --rolling; waits until it is ready"),
}


# ---------------------------------------------------------------- argparse

def _controller_urls(text: str) -> str:
    """argparse type: one URL, or several comma-separated."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a URL http://HOST:PORT, got {text!r}")
    return ",".join(http_url(p) for p in parts)


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    """The options every subcommand takes, given before or after its name (after wins)."""
    def d(value: object) -> object:   # after the subcommand: only what is given
        return value if top else argparse.SUPPRESS
    if top:
        add_config_option(p, "controller.peers / host / port and controller.tls are used")
    else:
        p.add_argument("-c", "--config", metavar="FILE", default=argparse.SUPPRESS,
                       type=_config_type(), help="as before the subcommand")
    p.add_argument("--controller", metavar="URL[,URL...]", action="append", type=_controller_urls,
                   default=d(None),
                   help=HELP_CONTROLLER + "; repeatable, tried in turn (default: "
                        "controller.peers of the config, else controller.host and "
                        "controller.port)")
    p.add_argument("--output", metavar="FORMAT", choices=["table", "json"], default=d("table"),
                   help="table (aligned columns) or json (the controller's documents)"
                        + ("" if top else " (default: table)"))


def _config_type() -> Callable[[str], str]:
    from motor.cli import config_file
    return config_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Operate a running cluster through its controller's API: list instances and nodes; "
        "drain, stop, start or restart an instance (the controller tells its node manager); "
        "a rolling restart of every instance, least hot cache first. Exit status 0 done, 1 "
        "refused by the controller (its error is printed), unreachable, or not done in time, "
        "2 bad options.")
    _common(p, top=True)
    sub = p.add_subparsers(dest="ctl_command", metavar="SUBCOMMAND", parser_class=Parser)
    sub.required = True
    for name, (_fn, help_text) in COMMANDS.items():
        s = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=HelpFormatter)
        _common(s, top=False)
        if name in ("drain", "stop", "start"):
            s.add_argument("id", metavar="ID", help="instance id, <node>/<engine>/<i>")
        if name == "restart":
            s.add_argument("id", metavar="ID", nargs="?", default=None,
                           help="instance id, <node>/<engine>/<i> (or --rolling)")
            s.add_argument("--rolling", action="store_true",
                           help="restart every instance that is not stopped or draining, one "
                                "at a time, each ready again before the next, least hot first")
            s.add_argument("--coordinator", metavar="URL", action="append", default=None,
                           type=http_url,
                           help="a coordinator whose GET /instances gives the KV-index blocks "
                                "of each instance (its API port; with workers > 1 its "
                                "management_port); repeatable; none: instance id order")
            s.add_argument("--drain", action=argparse.BooleanOptionalAction, default=True,
                           help="drain first (no new requests, the ones in flight finish); "
                                "--no-drain stops at once")
        if name in ("drain", "restart"):
            s.add_argument("--timeout", metavar="S", type=non_negative_float, default=60.0,
                           help="longest wait for the instance's requests in flight to finish "
                                "before it is stopped anyway, in seconds")
            s.add_argument("--grace", metavar="S", type=non_negative_float, default=None,
                           help="seconds between the drain's announcement and the first look "
                                "at the instance's requests, so every coordinator stopped "
                                "routing to it (default: 2 x the node manager's heartbeat "
                                "interval)")
            s.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                           help="wait until the instance is "
                                + ("stopped" if name == "drain" else "ready again")
                                + "; --no-wait returns once the controller accepted")
            s.add_argument("--wait-timeout", metavar="S", type=positive_float, default=None,
                           help="longest wait, in seconds (default: --timeout + "
                                + (f"{DRAIN_WAIT_MARGIN_S:g}" if name == "drain"
                                   else f"{RESTART_WAIT_MARGIN_S:g}") + ")")


def client_for(args: argparse.Namespace) -> ControllerClient:
    """The controller client of the options: ``--controller`` URLs, else the config's
    ``controller.urls``; ``controller.tls`` of the config.

    Raises
    ------
    ConfigError
        a config that does not load, a URL whose scheme does not fit ``controller.tls``, a
        TLS file that does not load.
    """
    from motor.config.load import load_config, load_default_config
    from motor.control_tls import client_context, controller_endpoint
    cfg = load_config(args.config) if args.config else load_default_config()
    urls = [u for spec in (args.controller or []) for u in spec.split(",")] or \
        cfg.controller.urls
    tls = cfg.controller.tls
    for u in urls:
        controller_endpoint(u, tls)
    return ControllerClient(urls, client_context(tls) if tls is not None else None)


def main(args: argparse.Namespace) -> int:
    fn = COMMANDS[args.ctl_command][0]
    try:
        client = client_for(args)
        return fn(client, args)
    except ConfigError as e:
        return fail("ctl", e, EXIT_USAGE)
    except CtlError as e:
        return fail("ctl", e, EXIT_FAILED)
