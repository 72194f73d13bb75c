"""The run report page: one self-contained HTML file (``gcore report RUN_DIR`` writes ``report.html``).

Curves of the metrics (reward, loss, stage times, the placement split, async staleness: the panels whose columns
``metrics.csv`` has) as hand-drawn SVG, and a browser of the traced samples (``samples.jsonl``) with a filter by
step, by reward range and by text. The data and the script are inline: the page needs no network and no server.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence
from typing import Any

#: the page's panels: (title, column prefixes or names); a panel shows the columns metrics.csv has
PAGE_PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "reward/std", "eval/accuracy_greedy", "eval/accuracy_sampled"]),
    ("loss", ["loss", "grad_norm", "kl", "entropy"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("stage times (s)", ["time/generate", "time/reward", "time/swap", "time/prepare", "time/train", "time/sync",
                         "time/trace", "time/step"]),
    ("placement", ["placement/"]),
    ("async staleness", ["async/"]),
]


def panels(rows: Sequence[dict[str, float]]) -> list[dict[str, Any]]:
    """Each panel with data: its title and its series ``{name: [[step, value], ...]}`` (NaN cells left out)."""
    columns = sorted({key for row in rows for key in row})
    out = []
    for title, wanted in PAGE_PANELS:
        names = [c for w in wanted for c in (sorted(c for c in columns if c.startswith(w)) if w.endswith("/")
                                             else [w] if w in columns else [])]
        series = {}
        for name in names:
            points = [[row.get("step", float(i)), row[name]] for i, row in enumerate(rows)
                      if isinstance(row.get(name), float) and math.isfinite(row[name])]
            if points:
                series[name] = points
        if series:
            out.append({"title": title, "series": series})
    return out


def page(run_dir: str, rows: Sequence[dict[str, float]], records: Sequence[dict[str, Any]], summary: str) -> str:
    """The page's HTML."""
    data = json.dumps({"panels": panels(rows), "samples": list(records)}, ensure_ascii=True, allow_nan=False)
    data = data.replace("</", "<\\/")  # nothing in the data can close the script element
    return _TEMPLATE.replace("{{title}}", html.escape(run_dir)).replace("{{summary}}", html.escape(summary)) \
        .replace("{{data}}", data)


def write_page(run_dir: str, rows: Sequence[dict[str, float]], records: Sequence[dict[str, Any]], summary: str,
               out: str | None = None) -> str:
    """Write the page (default ``RUN_DIR/report.html``); returns its path."""
    path = out or os.path.join(run_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page(run_dir, rows, records, summary))
    return path


_TEMPLATE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gcore run {{title}}</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.4em}
pre.summary{background:#f5f5f5;padding:.6em;font-size:.85em;white-space:pre-wrap}
#charts{display:flex;flex-wrap:wrap;gap:1em}
.chart{border:1px solid #ddd;padding:.4em}.chart h3{font-size:.95em;margin:.2em 0}
.legend{font-size:.75em}.legend span{display:inline-block;margin-right:.8em}
.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.25em;vertical-align:middle}
#filters{display:flex;gap:1em;flex-wrap:wrap;align-items:center;margin:.6em 0}
table{border-collapse:collapse;font-size:.8em;width:100%}
td,th{border:1px solid #ddd;padding:.25em .4em;vertical-align:top;text-align:left}
td.text{white-space:pre-wrap;max-width:38em;font-family:monospace}
</style></head><body>
<h1>gcore run <code>{{title}}</code></h1>
<pre class="summary">{{summary}}</pre>
<h2>Curves</h2><div id="charts"></div>
<h2>Samples</h2>
<div id="filters">
<label>step <select id="step"><option value="">all</option></select></label>
<label>reward from <input id="rmin" type="number" step="any" size="6"></label>
<label>to <input id="rmax" type="number" step="any" size="6"></label>
<label>text <input id="search" type="search" placeholder="prompt or reply contains"></label>
<span id="count"></span>
</div>
<table id="samples"><thead><tr><th>step</th><th>rank</th><th>reward</th><th>advantage</th><th>length</th>
<th>finish</th><th>version</th><th>logprob gap</th><th>prompt</th><th>reply</th></tr></thead><tbody></tbody></table>
<script id="data" type="application/json">{{data}}</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const COLOURS = ["#1f77b4","#d62728","#2ca02c","#ff7f0e","#9467bd","#8c564b","#e377c2","#7f7f7f","#17becf"];
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}
function fmt(v) { return v === null || v === undefined ? "-" : (typeof v === "number" ? +v.toPrecision(4) : v); }
function chart(panel) {
  const W = 440, H = 220, L = 48, R = 10, T = 10, B = 28;
  const box = document.createElement("div"); box.className = "chart";
  box.innerHTML = "<h3></h3>"; box.querySelector("h3").textContent = panel.title;
  const svg = el("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`}, box);
  const all = Object.values(panel.series).flat();
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}, svg);
  el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}, svg);
  for (const [v, y] of [[y0, H - B], [y1, T + 8]]) el("text", {x: 2, y: y, "font-size": 10}, svg).textContent = fmt(v);
  for (const [v, x] of [[x0, L], [x1, W - R - 20]])
    el("text", {x: x, y: H - 8, "font-size": 10}, svg).textContent = fmt(v);
  el("text", {x: W / 2, y: H - 2, "font-size": 10}, svg).textContent = "step";
  const legend = document.createElement("div"); legend.className = "legend";
  Object.entries(panel.series).forEach(([name, points], i) => {
    const colour = COLOURS[i % COLOURS.length];
    const d = points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join("");
    el("path", {d: d, fill: "none", stroke: colour, "stroke-width": 1.5, "data-series": name,
                "data-points": points.length}, svg);
    if (points.length < 60) for (const p of points) el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2, fill: colour}, svg);
    const item = document.createElement("span");
    item.innerHTML = `<i style="background:${colour}"></i>`; item.append(name); legend.appendChild(item);
  });
  box.appendChild(legend);
  return box;
}
const charts = document.getElementById("charts");
if (!DATA.panels.length) charts.textContent = "metrics.csv has no columns to plot yet";
for (const panel of DATA.panels) charts.appendChild(chart(panel));

const stepSelect = document.getElementById("step");
for (const s of [...new Set(DATA.samples.map(r => r.step))].sort((a, b) => a - b)) {
  const o = document.createElement("option"); o.value = s; o.textContent = s; stepSelect.appendChild(o);
}
const tbody = document.querySelector("#samples tbody");
function row(r) {
  const tr = document.createElement("tr");
  const version = r.version_min === r.version_max ? r.version_min : r.version_min + "-" + r.version_max;
  const cells = [r.step, r.rank, fmt(r.reward), fmt(r.advantage), r.length, r.finish_reason, version,
                 fmt(r.logprob_gap), r.prompt, r.transcript || r.reply];
  cells.forEach((c, i) => { const td = document.createElement("td"); if (i >= 8) td.className = "text";
                            td.textContent = c === undefined ? "" : String(c); tr.appendChild(td); });
  return tr;
}
function refresh() {
  const step = stepSelect.value, text = document.getElementById("search").value.toLowerCase();
  const lo = parseFloat(document.getElementById("rmin").value), hi = parseFloat(document.getElementById("rmax").value);
  const shown = DATA.samples.filter(r => (step === "" || String(r.step) === step)
    && (isNaN(lo) || (r.reward !== null && r.reward >= lo)) && (isNaN(hi) || (r.reward !== null && r.reward <= hi))
    && (!text || (r.prompt + "\n" + r.reply + "\n" + (r.transcript || "")).toLowerCase().includes(text)));
  tbody.replaceChildren(...shown.slice(0, 2000).map(row));
  document.getElementById("count").textContent = `${shown.length} of ${DATA.samples.length} samples`
    + (shown.length > 2000 ? " (the first 2000 shown)" : "");
}
for (const id of ["step", "rmin", "rmax", "search"]) for (const kind of ["input", "change"])
  document.getElementById(id).addEventListener(kind, refresh);
refresh();
</script></body></html>
"""
