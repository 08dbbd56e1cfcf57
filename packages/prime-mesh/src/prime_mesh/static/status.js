// The status page: polls /api/status and builds the DOM with textContent only, so anything a
// node sends is shown as text, never parsed as markup. No external scripts: works offline.
"use strict";

const REFRESH_MS = 2000;
const COLORS = ["#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518", "#72b7b2", "#9d755d", "#eeca3b"];
let lastRunId = null;
let lastOk = null;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function num(v, digits) {
  if (v === undefined || v === null) return "–";
  return Number(v).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function bytes(v) {
  if (v === undefined || v === null) return "–";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return v.toFixed(i ? 2 : 0) + " " + units[i];
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString("en-GB");
}

function colorOf(nodeId) {
  const n = parseInt(String(nodeId).split("-").pop(), 10);
  return COLORS[(isNaN(n) ? 0 : n - 1) % COLORS.length];
}

function splitBar(p) {
  const wrap = el("span");
  const parts = [["compute", p.compute_seconds], ["allreduce", p.allreduce_seconds], ["wait", p.wait_seconds]];
  const total = parts.reduce((s, [, v]) => s + (v || 0), 0);
  if (!total) { wrap.textContent = "–"; return wrap; }
  const bar = el("span", null, "split");
  for (const [name, v] of parts) {
    const seg = el("span", null, "c-" + name);
    seg.style.width = (100 * (v || 0) / total).toFixed(1) + "%";  // CSSOM: allowed by the CSP
    bar.appendChild(seg);
  }
  wrap.appendChild(bar);
  wrap.appendChild(document.createTextNode(parts.map(([, v]) => num(v || 0, 1)).join(" · ") + " s"));
  return wrap;
}

function renderNodes(status) {
  const body = document.querySelector("#nodes tbody");
  const rows = [];
  for (const n of status.nodes) {
    const p = n.progress || {};
    const gone = n.state === "evicted" || n.state === "left";
    const tr = el("tr", null, gone ? "gone" : "");
    const name = el("td");
    const sw = el("span", null, "swatch");
    sw.style.background = colorOf(n.node_id);
    name.appendChild(sw);
    name.appendChild(document.createTextNode(n.node_id));
    tr.appendChild(name);
    const st = el("td");
    st.appendChild(el("span", n.state, "state state-" + n.state));
    if (gone) st.appendChild(document.createTextNode(" " + clock(n.time)));
    tr.appendChild(st);
    tr.appendChild(el("td", n.address || "–"));
    tr.appendChild(el("td", n.rank === undefined || n.rank === null ? "–" : n.rank, "num"));
    tr.appendChild(el("td", gone ? "–" : num(n.last_heartbeat_age, 1) + " s ago", "num"));
    tr.appendChild(el("td", p.step === undefined ? "–" : p.step, "num"));
    tr.appendChild(el("td", p.outer_step === undefined ? "–" : p.outer_step, "num"));
    tr.appendChild(el("td", num(p.tokens_per_s, 0), "num"));
    tr.appendChild(el("td", num(p.loss, 4), "num"));
    tr.appendChild(el("td", num(p.eval_loss, 4), "num"));
    tr.appendChild(el("td", p.outer_seconds === undefined ? "–" : num(p.outer_seconds, 2) + " s", "num"));
    tr.appendChild(el("td", bytes(p.bytes_sent), "num"));
    tr.appendChild(el("td", p.ckpt_errors === undefined ? "–" : p.ckpt_errors, p.ckpt_errors ? "num warn" : "num"));
    const split = el("td");
    split.appendChild(splitBar(p));
    tr.appendChild(split);
    // details: why a node is gone, else its public metadata, as text
    const meta = Object.entries(n.metadata || {}).map(([k, v]) => k + "=" + (typeof v === "string" ? v : JSON.stringify(v)));
    const details = el("td", null, "details");
    for (const line of gone ? [n.reason] : meta) details.appendChild(el("div", line));
    tr.appendChild(details);
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function renderEvents(status) {
  const body = document.querySelector("#events tbody");
  const rows = status.events.slice().reverse().map((e) => {
    const tr = el("tr");
    tr.appendChild(el("td", clock(e.time)));
    tr.appendChild(el("td", e.epoch, "num"));
    const kind = el("td");
    kind.appendChild(el("span", e.kind, "state state-" + ({ formed: "member", joined: "member", rebuilt: "joining" }[e.kind] || e.kind)));
    tr.appendChild(kind);
    tr.appendChild(el("td", e.node_id || "–"));
    tr.appendChild(el("td", e.reason));
    tr.appendChild(el("td", e.members.join(", ") || "(none)"));
    return tr;
  });
  body.replaceChildren(...rows);
}

function drawLoss(status) {
  const canvas = document.getElementById("loss-chart");
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 56, R = 130, T = 12, B = 34;
  ctx.clearRect(0, 0, W, H);
  const series = Object.entries(status.series).sort(([a], [b]) => a.localeCompare(b, "en", { numeric: true }));
  const pts = [];
  for (const [, s] of series) for (const p of s) {
    if (p.step === undefined) continue;
    if (p.loss !== undefined) pts.push([p.step, p.loss]);
    if (p.eval_loss !== undefined) pts.push([p.step, p.eval_loss]);
  }
  canvas.dataset.points = String(pts.length);
  ctx.font = "12px system-ui, sans-serif";
  ctx.fillStyle = "#66707f";
  if (!pts.length) { ctx.fillText("no loss reported yet", L, H / 2); return; }
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
  const X = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  ctx.strokeStyle = "#eceef2"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    ctx.beginPath(); ctx.moveTo(L, Y(y)); ctx.lineTo(W - R, Y(y)); ctx.stroke();
    ctx.fillText(y.toFixed(2), 8, Y(y) + 4);
    const x = x0 + (x1 - x0) * i / 4;
    ctx.fillText(String(Math.round(x)), X(x) - 8, H - B + 16);
  }
  ctx.fillText("step", (L + W - R) / 2, H - 4);
  let legendY = T + 8;
  let ring = 0;
  for (const [nodeId, s] of series) {
    const radius = 3.5 + 2 * ring++;  // held-out rings grow per node: equal values stay visible
    const color = colorOf(nodeId);
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 2;
    ctx.beginPath();
    let started = false;
    for (const p of s) {
      if (p.loss === undefined || p.step === undefined) continue;
      if (started) ctx.lineTo(X(p.step), Y(p.loss)); else { ctx.moveTo(X(p.step), Y(p.loss)); started = true; }
    }
    ctx.stroke();
    for (const p of s) {
      if (p.eval_loss === undefined || p.step === undefined) continue;
      ctx.beginPath(); ctx.arc(X(p.step), Y(p.eval_loss), radius, 0, 2 * Math.PI); ctx.stroke();
    }
    ctx.fillRect(W - R + 12, legendY - 8, 10, 10);
    ctx.fillStyle = "#1d2330";
    ctx.fillText(nodeId, W - R + 28, legendY + 1);  // canvas text: never markup
    legendY += 18;
  }
}

function render(status) {
  const members = status.members.length;
  const waiting = status.nodes.filter((n) => n.state === "joining" || n.state === "registering").length;
  const steps = status.nodes.filter((n) => n.state === "member" && n.progress.step !== undefined).map((n) => n.progress.step);
  document.getElementById("summary").textContent =
    `epoch ${status.epoch} · ${members} member${members === 1 ? "" : "s"}` +
    (waiting ? ` · ${waiting} waiting` : "") +
    (steps.length ? ` · step ${Math.max(...steps)}` : "") + ` · min_nodes ${status.min_nodes}`;
  const h = status.history;
  let note = `History since the coordinator started at ${new Date(h.started * 1000).toLocaleString("en-GB")} (kept bounded; a restarted coordinator starts a new one).`;
  if (lastRunId !== null && lastRunId !== h.run_id) note = "The coordinator restarted: its history starts again. " + note;
  lastRunId = h.run_id;
  document.getElementById("history").textContent = note;
  renderNodes(status);
  renderEvents(status);
  drawLoss(status);
}

async function refresh() {
  const conn = document.getElementById("connection");
  try {
    const r = await fetch("/api/status", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    lastOk = new Date();
    conn.className = "muted";
    conn.textContent = "updated " + lastOk.toLocaleTimeString("en-GB") + " · refreshes every " + REFRESH_MS / 1000 + " s";
  } catch (err) {
    conn.className = "warn";
    conn.textContent = "cannot reach the coordinator (" + err.message + ")" +
      (lastOk ? "; showing data from " + lastOk.toLocaleTimeString("en-GB") : "");
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
