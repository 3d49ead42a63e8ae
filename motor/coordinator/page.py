"""The coordinator's view, ``GET /cluster`` on a coordinator (its API port with one worker,
the management port of the feed with several): one self-contained HTML document (inline CSS
and JavaScript, nothing fetched from elsewhere) that polls the same origin's ``GET
/instances`` every second and shows what this gateway routes to: each endpoint's instance,
role, URL, whether it is ready in the controller's table and routable here (its circuit
breaker), requests and tokens in flight, KV-index blocks and the engine's waiting / running
requests where known, plus the table version and the sum of requests in flight.

The controller's ``/cluster`` (:mod:`motor.controller.page`) shows the cluster as the
controller knows it; this one what one coordinator does with it. Test hooks: each endpoint
row is ``<tr data-endpoint=KEY data-routable=true|false>``; the body has ``data-version``.
"""
from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>motor coordinator</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2430; }
header { padding: 12px 20px; background: #fff; border-bottom: 1px solid #dde1e7;
         display: flex; gap: 24px; align-items: baseline; flex-wrap: wrap; }
h1 { font-size: 18px; margin: 0; }
.k { color: #6a7385; } .v { font-weight: 600; }
table { border-collapse: collapse; margin: 16px 20px; background: #fff; width: calc(100% - 40px);
        border: 1px solid #dde1e7; border-radius: 6px; }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #eef0f3; }
th { color: #6a7385; font-weight: 500; font-size: 12px; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.pill { display: inline-block; padding: 1px 10px; border-radius: 10px; color: #fff;
        font-size: 12px; font-weight: 600; }
.yes { background: #1f9d55; } .no { background: #c53030; } .wait { background: #b7791f; }
#err { color: #c53030; margin: 0 20px; }
</style>
</head>
<body data-version="">
<header>
  <h1>motor coordinator</h1>
  <span><span class="k">table version</span> <span class="v" id="version">-</span></span>
  <span><span class="k">routable</span> <span class="v" id="routable">-</span></span>
  <span><span class="k">in flight</span> <span class="v" id="inflight">-</span></span>
  <span><span class="k">worker</span> <span class="v" id="pid">-</span></span>
  <span class="k" id="status">connecting</span>
</header>
<p id="err"></p>
<table>
  <thead><tr><th>endpoint</th><th>instance</th><th>role</th><th>url</th><th>ready</th>
  <th>routable</th><th>in flight</th><th>tokens in flight</th><th>KV blocks</th>
  <th>engine waiting / running</th></tr></thead>
  <tbody id="rows"></tbody>
</table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const txt = (v) => (v === null || v === undefined) ? "-" : String(v);
function pill(ok, yes, no) {
  const s = document.createElement("span");
  s.className = "pill " + (ok === null || ok === undefined ? "wait" : ok ? "yes" : "no");
  s.textContent = ok === null || ok === undefined ? "?" : ok ? yes : no;
  return s;
}
function cell(tr, value, cls) {
  const td = document.createElement("td");
  if (value instanceof Node) td.appendChild(value); else td.textContent = txt(value);
  if (cls) td.className = cls;
  tr.appendChild(td);
}
function render(doc) {
  const eps = doc.endpoints || [];
  const rows = document.createDocumentFragment();
  let inflight = 0, routable = 0;
  for (const e of eps) {
    const ok = e.routable === undefined ? e.ready : e.routable;
    if (ok) routable += 1;
    inflight += e.inflight || 0;
    const tr = document.createElement("tr");
    tr.dataset.endpoint = e.key;
    tr.dataset.routable = String(!!ok);
    cell(tr, e.key);
    cell(tr, e.instance);
    cell(tr, e.role);
    cell(tr, e.url);
    cell(tr, pill(e.ready, "ready", "not ready"));
    cell(tr, pill(ok, "yes", "no"));
    cell(tr, e.inflight, "n");
    cell(tr, e.inflight_tokens, "n");
    cell(tr, e.kv_blocks, "n");
    const eng = e.engine;
    cell(tr, eng ? txt(eng.waiting) + " / " + txt(eng.running) : "-", "n");
    rows.appendChild(tr);
  }
  $("rows").replaceChildren(rows);
  $("version").textContent = txt(doc.version);
  $("routable").textContent = routable + " of " + eps.length;
  $("inflight").textContent = String(inflight);
  $("pid").textContent = txt(doc.worker_pid);
  document.body.dataset.version = txt(doc.version);
}
async function poll() {
  try {
    const r = await fetch("instances", {cache: "no-store"});
    if (!r.ok) throw new Error("GET /instances answered " + r.status);
    render(await r.json());
    $("err").textContent = "";
    $("status").textContent = "live";
  } catch (e) {
    $("err").textContent = String(e);
    $("status").textContent = "retrying";
  }
  setTimeout(poll, 1000);
}
poll();
</script>
</body>
</html>
"""

PAGE_BYTES = PAGE.encode()
CONTENT_TYPE = b"text/html; charset=utf-8"

__all__ = ["CONTENT_TYPE", "PAGE", "PAGE_BYTES"]
