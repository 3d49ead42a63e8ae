"""The live cluster page, ``GET /cluster`` on the controller: one self-contained HTML document
(inline CSS and JavaScript, nothing fetched from elsewhere, no build step).

The page polls the controller it was served by (same origin):

* ``GET /v1/instances?after=V&timeout=20``: the instance table as a long poll (answers as
  soon as the table changes), so a state change shows within the poll's round trip;
* every second ``GET /v1/engines`` (:mod:`motor.controller.engine_metrics`: running /
  waiting requests, KV-cache usage, prefix-cache hit share, the engines' TTFT sums),
  ``GET /v1/nodes`` and ``GET /v1/leader``.

It shows the leader, the table version, instance counts by state, a one-minute sparkline
of the cluster's request rate and mean TTFT (from the engines' TTFT histogram counts and
sums between two polls), and per node its instances with state (coloured), role, model,
endpoints, running / waiting requests, KV usage, prefix hit share, request rate, TTFT and
the reason of the last transition. When a request fails the page asks ``/v1/leader`` (of
this controller, then of the peers it named: ``controller.peers``, whose ``/v1/leader``
allows any origin) and moves to the leader's page if another controller leads (a follower redirects API calls,
which a browser does not follow across origins).

Hooks for tests: each instance row is ``<tr data-instance=ID data-state=STATE>``; the body
has ``data-version`` (table version shown) and ``data-engines`` (the ``scraped_at`` of the
engine figures shown).
"""
from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>motor cluster</title>
<style>
:root { --fg:#1d2330; --muted:#6b7385; --line:#dfe3ea; --bg:#f6f7f9; --card:#fff;
        --ready:#1f9d55; --starting:#2f6fdf; --unhealthy:#d93025; --draining:#e8a100;
        --stopped:#7d8596; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
       color:var(--fg); background:var(--bg); }
header { display:flex; flex-wrap:wrap; gap:18px; align-items:center; padding:12px 20px;
         background:var(--card); border-bottom:1px solid var(--line); }
header h1 { font-size:18px; margin:0 8px 0 0; }
.kv { color:var(--muted); } .kv b { color:var(--fg); font-weight:600; }
#conn.bad { color:var(--unhealthy); font-weight:600; }
main { padding:16px 20px; }
.node { background:var(--card); border:1px solid var(--line); border-radius:8px;
        margin-bottom:16px; overflow:hidden; }
.node h2 { font-size:15px; margin:0; padding:10px 14px; border-bottom:1px solid var(--line);
           display:flex; gap:16px; align-items:baseline; }
.node h2 span { font-weight:400; color:var(--muted); font-size:13px; }
table { border-collapse:collapse; width:100%; }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line);
         white-space:nowrap; }
th { font-weight:600; color:var(--muted); font-size:12px; }
tr:last-child td { border-bottom:0; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
.state { display:inline-block; min-width:78px; text-align:center; padding:1px 8px;
         border-radius:10px; color:#fff; font-size:12px; font-weight:600; }
.s-ready { background:var(--ready); } .s-starting { background:var(--starting); }
.s-unhealthy { background:var(--unhealthy); } .s-draining { background:var(--draining); }
.s-stopped, .s-removed { background:var(--stopped); }
.bar { display:inline-block; width:70px; height:8px; background:var(--line); border-radius:4px;
       vertical-align:middle; margin-right:6px; overflow:hidden; }
.bar i { display:block; height:100%; background:var(--starting); }
.down { color:var(--unhealthy); }
.reason { color:var(--muted); white-space:normal; max-width:340px; }
#spark { display:flex; gap:18px; align-items:center; }
#spark svg { background:var(--bg); border:1px solid var(--line); border-radius:4px; }
.empty { padding:24px; color:var(--muted); }
</style>
</head>
<body data-version="" data-engines="">
<header>
  <h1>motor cluster</h1>
  <span class="kv">leader <b id="leader">?</b></span>
  <span class="kv">table version <b id="version">?</b></span>
  <span class="kv" id="counts"></span>
  <span id="spark"></span>
  <span class="kv" id="conn">connecting</span>
</header>
<main id="nodes"><div class="empty">waiting for the instance table</div></main>
<script>
"use strict";
const S = { table: null, nodes: [], leader: null, engines: null, prev: null,
            history: [], rates: {} };
const ORDER = ["ready", "starting", "unhealthy", "draining", "stopped"];

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) {
    if (k === null || k === undefined) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}
function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  return Number(v).toFixed(digits === undefined ? 0 : digits);
}
function pct(v) { return v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %"; }
function ms(v) { return v === null || v === undefined ? "-" : (1000 * v).toFixed(1) + " ms"; }

async function getJSON(path, timeoutMs) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), timeoutMs);
  try {
    const r = await fetch(path, { cache: "no-store", signal: ctl.signal });
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return await r.json();
  } finally { clearTimeout(timer); }
}
function setConn(ok, text) {
  const c = document.getElementById("conn");
  c.textContent = text; c.className = ok ? "kv" : "kv bad";
}
async function followLeader() {
  // this controller first; when it is gone (killed), the other controllers it named
  // (controller.peers; their /v1/leader answers any origin)
  const here = location.origin;
  const ask = [""].concat((S.peers || []).filter((u) => u !== here));
  for (const base of ask) {
    try {
      const l = await getJSON(base + "/v1/leader", 3000);
      if (l.leader && l.leader !== here) { location.href = l.leader + "/cluster"; return; }
    } catch (e) { /* down: the next one */ }
  }
}
const sleep = (t) => new Promise((r) => setTimeout(r, t));

async function watchTable() {
  for (;;) {
    const q = S.table ? "?after=" + S.table.version + "&timeout=20" : "";
    try {
      S.table = await getJSON("/v1/instances" + q, 30000);
      setConn(true, "live");
      render();
    } catch (e) {
      setConn(false, "controller unreachable (" + e.message + ")");
      await followLeader();
      await sleep(1000);
    }
  }
}

function engineRates(eng) {
  // per endpoint key: request rate and mean TTFT between this poll and the previous one
  const prev = S.prev, out = {};
  let reqs = 0, ttftSum = 0, ttftN = 0;
  for (const e of eng.endpoints) {
    const key = e.instance + "#" + e.dp_rank;
    const p = prev && prev.by[key];
    if (p && e.ttft_count !== null && p.ttft_count !== null && eng.scraped_at > prev.at) {
      const dn = e.ttft_count - p.ttft_count, ds = e.ttft_sum_s - p.ttft_sum_s;
      const dt = eng.scraped_at - prev.at;
      if (dn >= 0) {
        out[key] = { rate: dn / dt, ttft: dn > 0 ? ds / dn : null };
        reqs += dn / dt; if (dn > 0) { ttftSum += ds; ttftN += dn; }
      }
    }
  }
  const by = {};
  for (const e of eng.endpoints) by[e.instance + "#" + e.dp_rank] = e;
  if (!prev || eng.scraped_at > prev.at) {
    if (prev) {
      S.history.push({ rate: reqs, ttft: ttftN ? ttftSum / ttftN : null });
      if (S.history.length > 60) S.history.shift();
    }
    S.prev = { at: eng.scraped_at, by };
    S.rates = out;
  }
}

async function pollOthers() {
  for (;;) {
    const [eng, nodes, leader] = await Promise.allSettled([
      getJSON("/v1/engines", 5000), getJSON("/v1/nodes", 5000), getJSON("/v1/leader", 5000)]);
    if (eng.status === "fulfilled") { S.engines = eng.value; engineRates(eng.value); }
    if (nodes.status === "fulfilled") S.nodes = nodes.value.nodes;
    if (leader.status === "fulfilled") {
      S.leader = leader.value;
      if (Array.isArray(leader.value.peers)) S.peers = leader.value.peers;
    }
    render();
    await sleep(1000);
  }
}

function spark(values, w, h, color) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h);
  const vs = values.map((v) => (v === null ? 0 : v));
  const max = Math.max(1e-9, ...vs);
  if (vs.length > 1) {
    const pts = vs.map((v, i) => (i * (w - 2) / (vs.length - 1) + 1).toFixed(1) + "," +
                                 (h - 1 - v / max * (h - 2)).toFixed(1)).join(" ");
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts); line.setAttribute("fill", "none");
    line.setAttribute("stroke", color); line.setAttribute("stroke-width", "1.5");
    svg.append(line);
  }
  return svg;
}

function render() {
  const t = S.table;
  if (S.leader) {
    document.getElementById("leader").textContent =
      (S.leader.leader || "none") + (S.leader.is_leader ? " (this one)" : "");
  }
  if (!t) return;
  document.body.dataset.version = String(t.version);
  document.getElementById("version").textContent = String(t.version);
  const counts = {};
  for (const i of t.instances) counts[i.state] = (counts[i.state] || 0) + 1;
  const cs = document.getElementById("counts"); cs.replaceChildren();
  for (const s of ORDER) {
    if (counts[s]) cs.append(el("span", { class: "state s-" + s, style: "margin-right:6px" },
                                  counts[s] + " " + s));
  }
  const h = S.history, last = h.length ? h[h.length - 1] : null;
  document.getElementById("spark").replaceChildren(
    el("span", { class: "kv" }, "requests/s ", el("b", {}, last ? fmt(last.rate, 1) : "-")),
    spark(h.map((x) => x.rate), 120, 26, "#2f6fdf"),
    el("span", { class: "kv" }, "TTFT ", el("b", {}, last ? ms(last.ttft) : "-")),
    spark(h.map((x) => x.ttft), 120, 26, "#e8a100"));

  const eps = {};
  if (S.engines) {
    document.body.dataset.engines = String(S.engines.scraped_at);
    for (const e of S.engines.endpoints) eps[e.instance + "#" + e.dp_rank] = e;
  }
  const byNode = new Map();
  for (const n of S.nodes) byNode.set(n.node, { info: n, insts: [] });
  for (const i of t.instances) {
    if (!byNode.has(i.node)) byNode.set(i.node, { info: null, insts: [] });
    byNode.get(i.node).insts.push(i);
  }
  const main = document.getElementById("nodes");
  if (!byNode.size) {
    main.replaceChildren(el("div", { class: "empty" }, "no node registered"));
    return;
  }
  const cards = [];
  for (const [name, { info, insts }] of [...byNode.entries()].sort()) {
    const head = el("h2", {}, name,
      info ? el("span", {}, info.host + (info.mgmt_port ? ":" + info.mgmt_port : "")) : null,
      info ? el("span", {}, "heartbeat " + fmt(info.last_heartbeat_age_s, 1) + " s ago") : null,
      el("span", {}, insts.length + " instance(s)"));
    const rows = [el("tr", {}, ...["instance", "state", "role", "model", "endpoint",
      "running", "waiting", "KV cache", "prefix hit", "req/s", "TTFT", "reason"].map(
        (c) => el("th", {}, c)))];
    for (const i of insts) {
      i.endpoints.forEach((ep, k) => {
        const key = i.id + "#" + ep.dp_rank, f = eps[key], r = S.rates[key];
        const up = f ? f.up : null;
        const kv = f && f.kv_usage !== null ? f.kv_usage : null;
        rows.push(el("tr", k === 0 ? { "data-instance": i.id, "data-state": i.state } :
                              { "data-rank-of": i.id },
          el("td", {}, k === 0 ? i.id : ""),
          el("td", {}, k === 0 ? el("span", { class: "state s-" + i.state }, i.state) : ""),
          el("td", {}, k === 0 ? i.role : ""),
          el("td", {}, k === 0 ? i.model : ""),
          el("td", { class: up === false ? "down" : null, title: f && f.error ? f.error : null },
             ep.host + ":" + ep.port + (i.endpoints.length > 1 ? " (dp " + ep.dp_rank + ")" : "")
             + (up === false ? " (no metrics)" : "")),
          el("td", { class: "num", "data-col": "running" }, f && up ? fmt(f.running) : "-"),
          el("td", { class: "num", "data-col": "waiting" }, f && up ? fmt(f.waiting) : "-"),
          el("td", { "data-col": "kv" }, kv === null || !up ? "-" :
             el("span", {}, el("span", { class: "bar" },
                               el("i", { style: "width:" + Math.min(100, 100 * kv) + "%" })),
                pct(kv))),
          el("td", { class: "num" }, f && up ? pct(f.prefix_hit_ratio) : "-"),
          el("td", { class: "num" }, r ? fmt(r.rate, 2) : "-"),
          el("td", { class: "num" }, r ? ms(r.ttft) : "-"),
          el("td", { class: "reason" }, k === 0 && i.reason ? i.reason : "")));
      });
    }
    cards.push(el("section", { class: "node", "data-node": name }, head, el("table", {}, ...rows)));
  }
  main.replaceChildren(...cards);
}

watchTable();
pollOthers();
</script>
</body>
</html>
"""

#: the page as served (UTF-8)
PAGE_BYTES = PAGE.encode()
CONTENT_TYPE = b"text/html; charset=utf-8"

__all__ = ["CONTENT_TYPE", "PAGE", "PAGE_BYTES"]
