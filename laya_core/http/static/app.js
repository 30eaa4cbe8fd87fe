// The live page: polls GET /live (spec/openapi.yaml, LiveSnapshot) and runs the chat
// playground on /v1/chat/completions. Plain JS, no build step, nothing fetched from elsewhere.
"use strict";

const KEY_ITEM = "laya-api-key";  // sessionStorage: the key lives in this tab only
const HISTORY = 120;              // samples kept for the sparkline (60 s at 2 a second)
let apiKey = sessionStorage.getItem(KEY_ITEM) || "";
let pollMs = 500;
let updates = 0;
let modelsLoaded = false;
const history = [];               // {kvUsed, kvTotal, tps}: the page's own rolling window

const $ = (id) => document.getElementById(id);

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
    '"': "&quot;", "'": "&#39;"}[c]));
}

// The same units as `laya plan` (laya_core/units.py fmt_bytes).
function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? n.toFixed(0) + " B" : n.toFixed(2) + " " + units[i];
}

function fmtMs(v) { return v === null || v === undefined ? "-" : v.toFixed(v < 10 ? 2 : 0); }

// A byte figure the tests read exactly: the text for people, data-bytes for machines.
function bytesCell(field, n) {
  return `<td data-field="${field}" data-bytes="${n === null ? "" : n}">${fmtBytes(n)}</td>`;
}

function needKey(message) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("status").textContent = "waiting for an API key";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("key-input").value.trim();
  sessionStorage.setItem(KEY_ITEM, apiKey);
  $("key-input").value = "";
  $("key-form").hidden = true;
  poll();
});

async function poll() {
  let r;
  try {
    r = await fetch("/live", {headers: headers(), cache: "no-store"});
  } catch (err) {
    $("status").textContent = "server unreachable; retrying";
    setTimeout(poll, 1000);
    return;
  }
  if (r.status === 401) {
    needKey(apiKey ? "that key was refused" : "");
    return;  // polling resumes when a key is given
  }
  if (!r.ok) {
    $("status").textContent = `GET /live answered ${r.status}; retrying`;
    setTimeout(poll, 1000);
    return;
  }
  const snap = await r.json();
  pollMs = snap.poll_interval_ms || pollMs;
  $("main").hidden = false;
  $("key-form").hidden = true;
  render(snap);
  if (!modelsLoaded) loadModels();
  setTimeout(poll, pollMs);
}

function render(snap) {
  updates++;
  const up = $("updated");
  up.dataset.count = String(updates);
  up.textContent = "updated " + new Date(snap.time * 1000).toLocaleTimeString();
  $("status").textContent = snap.ready ? "ready" : "loading";
  renderMemory(snap);
  $("models").innerHTML = snap.models.map(renderModel).join("");
  placeBars();
  let kvUsed = 0, kvTotal = 0, tps = 0;
  for (const m of snap.models) {
    tps += m.latency.tokens_per_s;
    for (const r of m.replicas) { kvUsed += r.kv.blocks_used; kvTotal += r.kv.blocks_total; }
  }
  history.push({kvUsed, kvTotal, tps});
  if (history.length > HISTORY) history.shift();
  drawSpark();
}

function renderMemory(snap) {
  const m = snap.memory;
  if (!m) { $("memory").innerHTML = "<p class=muted>no memory plan</p>"; return; }
  // Measured: the front end's resident set plus each worker's.
  let measured = snap.front_end_rss_bytes || 0;
  for (const model of snap.models) for (const r of model.replicas) measured += r.rss_bytes || 0;
  const scale = Math.max(m.budget_bytes, m.planned_bytes, measured);
  $("memory").innerHTML = `<table id="memory-table"><tr>
      <th>budget (${esc(m.budget_source)})</th><th>planned</th><th>front end planned</th>
      <th>front end RSS</th><th>RSS, all processes</th></tr><tr>
      ${bytesCell("budget_bytes", m.budget_bytes)}${bytesCell("planned_bytes", m.planned_bytes)}
      ${bytesCell("runtime_bytes", m.runtime_bytes)}
      ${bytesCell("front_end_rss_bytes", snap.front_end_rss_bytes)}
      ${bytesCell("measured_bytes", measured)}</tr></table>
    <div class="bar" title="the plan against the budget (the whole bar)">
      <span class="weights" data-width="${pct(m.planned_bytes, scale)}"></span>
      <span class="rss" data-left="${pct(measured, scale)}"></span></div>
    <div class="legend"><span class="sw weights"></span>planned<span class="sw rss"></span>RSS, all
      processes; the whole bar: ${fmtBytes(scale)}</div>`;
}

// The bars' widths and marks travel as data-width / data-left (percent) and are set through
// the DOM: the page's Content-Security-Policy (laya_core/http/live.py) refuses inline style
// attributes.
function placeBars() {
  for (const el of document.querySelectorAll("[data-width]")) el.style.width = el.dataset.width + "%";
  for (const el of document.querySelectorAll("[data-left]")) el.style.left = el.dataset.left + "%";
}

function pct(n, of) { return of ? Math.max(0, Math.min(100, 100 * n / of)) : 0; }

// One replica's ledger, drawn to its own total (or RSS, if larger) so the KV pool's use shows;
// the memory bar above draws the whole plan against the budget.
function ledgerBar(r) {
  const l = r.ledger;
  if (!l) return "";
  const scale = Math.max(l.total_bytes, r.rss_bytes || 0) * 1.05;
  const kvShare = r.kv.blocks_total ? l.kv_pool_bytes / r.kv.blocks_total : 0;
  const used = r.kv.blocks_used * kvShare, cached = r.kv.blocks_cached * kvShare;
  const rss = r.rss_bytes === null ? "" :
    `<span class="rss" data-left="${pct(r.rss_bytes, scale)}" title="RSS ${fmtBytes(r.rss_bytes)}"></span>`;
  return `<div class="bar" title="the ledger; the whole bar: ${fmtBytes(scale)}">
    <span class="weights" data-width="${pct(l.weights_bytes, scale)}"></span>
    <span class="kv" data-width="${pct(used, scale)}"></span>
    <span class="kvcached" data-width="${pct(cached, scale)}"></span>
    <span class="kvfree" data-width="${pct(l.kv_pool_bytes - used - cached, scale)}"></span>
    <span class="over" data-width="${pct(l.overhead_bytes, scale)}"></span>${rss}</div>`;
}

function renderReplica(m, r) {
  const l = r.ledger || {};
  const k = r.kv, p = r.prefix_cache;
  const rej = Object.entries(r.rejections).map(([k2, v]) => `${esc(k2)} ${v}`).join(", ") || "none";
  const overheads = (l.overheads || []).map((o) => `${esc(o.name)} ${fmtBytes(o.bytes)}`).join("; ");
  return `<div class="replica" data-model="${esc(m.name)}" data-replica="${r.replica}">
    <h3>${esc(m.name)} replica ${r.replica} <span class="muted">${esc(r.state)}, ${esc(r.process)} process</span></h3>
    ${r.error ? `<p class="error">${esc(r.error)}</p>` : ""}
    <table><tr><th>ledger</th><th>weights</th><th>KV pool</th><th>overheads</th><th>total</th><th>RSS</th></tr>
      <tr><td>planned</td>${bytesCell("weights_bytes", l.weights_bytes ?? null)}
      ${bytesCell("kv_pool_bytes", l.kv_pool_bytes ?? null)}${bytesCell("overhead_bytes", l.overhead_bytes ?? null)}
      ${bytesCell("total_bytes", l.total_bytes ?? null)}${bytesCell("rss_bytes", r.rss_bytes)}</tr></table>
    <div class="muted" title="overheads">${overheads}</div>
    ${ledgerBar(r)}
    <div class="legend"><span class="sw weights"></span>weights<span class="sw kv"></span>KV in use
      <span class="sw kvcached"></span>KV cached<span class="sw kvfree"></span>KV free<span class="sw over"></span>overheads<span class="sw rss"></span>RSS</div>
    <table><tr><th>KV blocks (${k.block_tokens} tokens)</th><th>in use</th><th>cached</th><th>free</th><th>total</th>
      <th>prefix hits</th><th>hit tokens</th><th>running</th><th>waiting</th></tr>
      <tr><td></td><td data-field="blocks_used">${k.blocks_used}</td><td data-field="blocks_cached">${k.blocks_cached}</td>
      <td data-field="blocks_free">${k.blocks_free}</td><td data-field="blocks_total">${k.blocks_total}</td>
      <td data-field="prefix_hits">${p.hit_sequences}</td><td data-field="prefix_hit_tokens">${p.hit_tokens} / ${p.queried_tokens}</td>
      <td data-field="running">${r.running}</td><td data-field="waiting">${r.waiting}</td></tr></table>
    <div class="muted">rejections: <span data-field="rejections">${rej}</span></div></div>`;
}

// A model loaded on demand: its state now, and its loads and unloads (by reason).
function renderResidency(r) {
  if (!r) return "";
  const unloads = Object.entries(r.unloads).map(([k, v]) => `${esc(k)} ${v}`).join(", ") || "none";
  const last = r.last_load_s === null ? "" : `, the last in ${r.last_load_s.toFixed(2)} s`;
  return `<div class="residency">loaded on demand: <b data-field="residency_status">${esc(r.status)}</b>;
    loads <span data-field="loads">${r.loads}</span>${last}; unloads <span data-field="unloads">${unloads}</span>
    ${r.idle_unload_s === null ? "" : `; unloaded after ${r.idle_unload_s} s idle`}
    ${r.error ? `<p class="error">${esc(r.error)}</p>` : ""}</div>`;
}

function renderModel(m) {
  const lat = m.latency;
  const rows = ["route", "queue", "prefill", "decode"].map((layer) => {
    const v = lat[layer + "_ms"];
    return `<tr data-layer="${layer}"><td>${layer}</td><td>${fmtMs(v.p50)}</td><td>${fmtMs(v.p99)}</td></tr>`;
  }).join("");
  const rej = Object.entries(m.rejections).map(([k, v]) => `${esc(k)} ${v}`).join(", ") || "none";
  return `<section class="model" data-model="${esc(m.name)}"><h2>${esc(m.name)}</h2>
    ${renderResidency(m.residency)}
    ${m.replicas.map((r) => renderReplica(m, r)).join("")}
    <h3>Latency, last ${lat.window_s} s (${lat.sequences} sequences)</h3>
    <table class="latency"><tr><th>layer</th><th>p50 ms</th><th>p99 ms</th></tr>${rows}</table>
    <div>tokens/s: <b data-field="tokens_per_s">${lat.tokens_per_s.toFixed(1)}</b>
      <span class="muted">rejections: ${rej}</span></div></section>`;
}

function drawSpark() {
  const c = $("spark"), g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const maxTps = Math.max(1, ...history.map((h) => h.tps));
  const line = (color, value) => {
    g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
    history.forEach((h, i) => {
      const x = c.width * i / (HISTORY - 1), y = c.height - 2 - (c.height - 4) * value(h);
      if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
    });
    g.stroke();
  };
  line("#e2904a", (h) => h.kvTotal ? h.kvUsed / h.kvTotal : 0);
  line("#2e8b57", (h) => h.tps / maxTps);
}

// -- chat playground ----------------------------------------------------------------------

const conversation = [];  // {role, content}: the turns so far, sent with each message
let controller = null;    // the AbortController of the reply now streaming

async function loadModels() {
  const r = await fetch("/v1/models", {headers: headers()});
  if (!r.ok) return;
  const select = $("chat-model");
  select.innerHTML = (await r.json()).data.map((m) => `<option>${esc(m.id)}</option>`).join("");
  modelsLoaded = true;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("chat-log").appendChild(div);
  return div;
}

function showTiming(div, t, note) {
  const span = document.createElement("span");
  span.className = "timing";
  span.textContent = t ? `route ${fmtMs(t.route_ms)} ms, queue ${fmtMs(t.queue_ms)} ms, ` +
    `prefill ${fmtMs(t.prefill_ms)} ms, decode ${fmtMs(t.decode_ms)} ms` : note;
  if (t) for (const k of ["route_ms", "queue_ms", "prefill_ms", "decode_ms"]) span.dataset[k.replace("_ms", "")] = t[k];
  div.appendChild(span);
}

async function send(text) {
  conversation.push({role: "user", content: text});
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.dataset.state = "streaming";
  const out = reply.querySelector(".text");
  const system = $("chat-system").value.trim();
  const body = {
    model: $("chat-model").value, stream: true,
    messages: (system ? [{role: "system", content: system}] : []).concat(conversation),
    temperature: Number($("chat-temperature").value),
    max_tokens: Number($("chat-max-tokens").value),
  };
  controller = new AbortController();
  $("chat-stop").disabled = false;
  $("chat-send").disabled = true;
  let timing = null, note = "";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", signal: controller.signal,
      headers: headers({"Content-Type": "application/json"}), body: JSON.stringify(body)});
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error((e.error && e.error.message) || `HTTP ${r.status}`);
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, cut);
        buffered = buffered.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && choice.delta.content) out.textContent += choice.delta.content;
          if (chunk.laya_timing) timing = chunk.laya_timing;
        }
      }
    }
    reply.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") { reply.dataset.state = "stopped"; note = "stopped"; }
    else { reply.dataset.state = "error"; note = "error: " + err.message; }
  }
  showTiming(reply, timing, note);
  conversation.push({role: "assistant", content: out.textContent});
  controller = null;
  $("chat-stop").disabled = true;
  $("chat-send").disabled = false;
}

$("chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || controller) return;
  $("chat-input").value = "";
  send(text);
});

// Aborting the fetch closes the connection; the server cancels the sequence and frees its KV.
$("chat-stop").addEventListener("click", () => { if (controller) controller.abort(); });

$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});

poll();
