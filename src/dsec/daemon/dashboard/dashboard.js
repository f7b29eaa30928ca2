// DSec dashboard: polls the node (or gateway) API every POLL_MS and follows /v1/events as a stream.
// Everything shown comes from sandboxes (commands, output, labels) and is untrusted: it is only ever put
// into the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;
const HISTORY = 90; // overview samples kept for the charts (3 minutes at POLL_MS)
const samples = [];
let token = null;
let selectedSandbox = null;
let selectedTrajectory = null;

function readToken() {
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("token")) {
    localStorage.setItem("dsec-token", hash.get("token"));
    history.replaceState(null, "", location.pathname); // keep the token out of the address bar
  }
  return localStorage.getItem("dsec-token");
}

async function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const response = await fetch(path, { headers });
  if (response.status === 401) {
    document.getElementById("token-form").hidden = false;
    throw new Error("this API needs a token");
  }
  if (!response.ok) {
    let message = response.statusText;
    try { message = (await response.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(path + ": " + message);
  }
  return response.json();
}

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  return td;
}

function fill(tableId, rows, onClick) {
  const body = document.querySelector("#" + tableId + " tbody");
  const fresh = document.createElement("tbody");
  for (const row of rows) {
    const tr = document.createElement("tr");
    for (const c of row.cells) tr.appendChild(c instanceof Node ? c : cell(c));
    if (row.id !== undefined) tr.dataset.id = row.id;
    if (onClick) { tr.className = "clickable"; tr.addEventListener("click", () => onClick(row.id)); }
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}

function age(seconds) {
  seconds = Math.max(0, Math.floor(seconds));
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds >= size) return Math.floor(seconds / size) + unit;
  }
  return seconds + "s";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

function when(t) { return new Date(t * 1000).toLocaleTimeString(); }

function commandText(command) { return Array.isArray(command) ? command.join(" ") : command; }

function pre(text) {
  const td = document.createElement("td");
  const p = document.createElement("pre");
  p.textContent = text;
  td.appendChild(p);
  return td;
}

// ----- charts ------------------------------------------------------------------------------------------

function series() {
  const out = { create: [], createLatency: [], exec: [], execLatency: [] };
  for (let i = 1; i < samples.length; i++) {
    const a = samples[i - 1], b = samples[i];
    const dt = Math.max(1e-3, b.at - a.at);
    const dCreated = b.created - a.created;
    const dExec = b.exec_count - a.exec_count;
    out.create.push(dCreated / dt);
    out.exec.push(dExec / dt);
    out.createLatency.push(dCreated > 0 ? 1000 * (b.create_seconds_sum - a.create_seconds_sum) / dCreated : 0);
    out.execLatency.push(dExec > 0 ? 1000 * (b.exec_seconds_sum - a.exec_seconds_sum) / dExec : 0);
  }
  return out;
}

function draw(svgId, values) {
  const svg = document.getElementById(svgId);
  svg.replaceChildren();
  if (values.length < 2) return;
  const max = Math.max(...values, 1e-9);
  const step = 300 / (HISTORY - 1);
  const offset = 300 - step * (values.length - 1);
  const points = values.map((v, i) => (offset + i * step).toFixed(1) + "," + (58 - 56 * v / max).toFixed(1));
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.join(" "));
  svg.appendChild(line);
}

function last(values) { return values.length ? values[values.length - 1].toFixed(values[values.length - 1] < 10 ? 2 : 0) : "-"; }

// ----- sections ----------------------------------------------------------------------------------------

function renderOverview(o) {
  if (!samples.length && o.history.length > 1) {
    // The node's own recent series: charts show the past half hour at once, then grow with every poll.
    for (const h of o.history.slice(-HISTORY, -1)) samples.push(h);
  }
  samples.push(o);
  if (samples.length > HISTORY) samples.shift();
  fill("nodes", o.nodes.map(n => ({ cells: [
    n.node, cell(n.alive ? "yes" : "no", n.alive ? "ok" : "bad"), cell(n.sandboxes, "num"),
    Object.entries(n.by_backend).map(([k, v]) => k + ": " + v).join(", "),
    n.load.map(x => x.toFixed(2)).join(" / "),
    n.memory_total_bytes ? bytes(n.memory_used_bytes) + " of " + bytes(n.memory_total_bytes) : "",
  ] })));
  const s = series();
  draw("chart-create", s.create); draw("chart-exec", s.exec);
  draw("chart-create-latency", s.createLatency); draw("chart-exec-latency", s.execLatency);
  document.getElementById("create-rate").textContent = last(s.create);
  document.getElementById("exec-rate").textContent = last(s.exec);
  document.getElementById("create-latency").textContent = last(s.createLatency);
  document.getElementById("exec-latency").textContent = last(s.execLatency);
  const execs = Object.entries(o.execs).map(([k, v]) => k + " " + v).join(", ");
  document.getElementById("totals").textContent =
    "created " + o.created + "; commands " + o.exec_count + (execs ? " (" + execs + ")" : "");
  const failures = Object.entries(o.failures).sort((a, b) => b[1] - a[1]);
  fill("failures", failures.length ? failures.map(([k, v]) => ({ cells: [k, cell(v, "num")] }))
    : [{ cells: [cell("no failures", "muted"), ""] }]);
  const im = o.images || {};
  document.getElementById("image-stats").textContent = im.cache_bytes === undefined ? "no image cache on this node"
    : "mounted " + im.mounted + " images (" + im.pins + " pins); chunk cache " + bytes(im.cache_bytes)
      + (im.cache_limit_bytes ? " of " + bytes(im.cache_limit_bytes) : " (no limit)");
  fill("pools", o.pools.length ? o.pools.map(p => ({ cells: [
    p.config.image + ":" + p.config.backend, cell(p.ready, "num"), cell(p.target, "num"), cell(p.hits, "num"),
    cell(p.misses, "num"), cell(p.failures, "num")] }))
    : [{ cells: [cell("no warm pools", "muted"), "", "", "", "", ""] }]);
}

function sandboxQuery() {
  const params = new URLSearchParams();
  const backend = document.getElementById("f-backend").value;
  const state = document.getElementById("f-state").value;
  const label = document.getElementById("f-label").value.trim();
  const job = document.getElementById("f-job").value.trim();
  if (backend) params.set("backend", backend);
  if (state) params.set("state", state);
  if (label.includes("=")) params.append("label", label);
  if (job) params.append("label", "dsec.job=" + job);
  return params.toString();
}

function renderSandboxes(list) {
  const image = document.getElementById("f-image").value.trim();
  const shown = image ? list.filter(s => (s.image || "").includes(image)) : list;
  const now = Date.now() / 1000;
  document.getElementById("sandbox-count").textContent = "(" + shown.length + ")";
  fill("sandboxes", shown.map(s => ({ id: s.id, cells: [
    s.id, s.backend, s.image || "", cell(s.state, s.state === "running" ? "ok" : s.state === "failed" ? "bad" : ""),
    age(now - s.created_at), s.node, Object.entries(s.labels).map(([k, v]) => k + "=" + v).join(" "),
    s.trajectory ? s.trajectory.name : "",
  ] })), showSandbox);
  const trajectories = list.filter(s => s.trajectory);
  fill("trajectories", trajectories.map(s => ({ id: s.trajectory.name, cells: [
    s.trajectory.name, s.id, cell(s.trajectory.calls, "num"), age(s.trajectory.lease_expires_at - now),
    s.trajectory.orphaned ? "yes" : "",
  ] })), showTrajectory);
}

async function showSandbox(id) {
  selectedSandbox = id;
  await refreshSandbox();
}

async function refreshSandbox() {
  if (!selectedSandbox) return;
  const entries = await api("/v1/sandboxes/" + encodeURIComponent(selectedSandbox) + "/logs?limit=50");
  document.getElementById("detail-section").hidden = false;
  document.getElementById("detail-title").textContent = "Commands of " + selectedSandbox;
  fill("detail", entries.map(e => ({ cells: [
    cell(e.id, "num"), when(e.at), e.who, pre(commandText(e.command)),
    cell(e.exit_code, e.outcome === "ok" ? "ok" : "bad"), e.limit || "", cell((e.duration_s * 1000).toFixed(1), "num"),
    pre(e.stdout + (e.stderr ? "\n[stderr] " + e.stderr : "")),
  ] })));
}

async function showTrajectory(name) {
  selectedTrajectory = name;
  await refreshTrajectory();
}

async function refreshTrajectory() {
  if (!selectedTrajectory) return;
  const steps = await api("/v1/trajectories/log?limit=200&name=" + encodeURIComponent(selectedTrajectory));
  document.getElementById("steps").hidden = false;
  fill("steps", steps.map(c => ({ cells: [
    cell(c.seq, "num"), c.op, cell(c.status, c.status === "done" ? "ok" : "bad"), pre(c.request || c.digest),
    cell(c.duration_s === null ? "" : (c.duration_s * 1000).toFixed(1), "num"),
  ] })));
}

function renderAudit(entries) {
  fill("audit", entries.map(e => ({ id: e.sandbox_id, cells: [
    when(e.at), e.sandbox_id, e.who, e.job || "", pre(commandText(e.command)),
    cell(e.outcome + (e.limit ? " (" + e.limit + ")" : ""), e.outcome === "ok" ? "ok" : "bad"),
    cell(e.exit_code, "num"), cell((e.duration_s * 1000).toFixed(1), "num"),
  ] })), showSandbox);
}

function renderImages(images) {
  fill("images", images.map(i => ({ cells: [i.name, cell(bytes(i.size_bytes), "num"), cell(i.files, "num"), i.source] })));
}

// ----- events stream -----------------------------------------------------------------------------------

async function followEvents() {
  let since = 0; // null: live only (a server that refuses ?since= with 501, as gateways before issue 10c did)
  for (;;) {
    try {
      const headers = token ? { Authorization: "Bearer " + token } : {};
      const response = await fetch(since === null ? "/v1/events" : "/v1/events?since=" + since, { headers });
      if (response.status === 501 && since !== null) { since = null; continue; }
      if (response.status === 401) {
        document.getElementById("token-form").hidden = false;
        throw new Error("this API needs a token");
      }
      if (!response.ok) throw new Error("events: HTTP " + response.status);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffered = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffered += decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buffered.indexOf("\n")) >= 0) {
          const event = JSON.parse(buffered.slice(0, nl));
          buffered = buffered.slice(nl + 1);
          if (since !== null) since = Math.max(since, event.seq);
          addEvent(event);
        }
      }
    } catch (err) {
      document.getElementById("status").textContent = String(err.message || err);
    }
    await new Promise(r => setTimeout(r, POLL_MS));
  }
}

function addEvent(e) {
  const list = document.getElementById("events");
  const li = document.createElement("li");
  li.dataset.kind = e.kind;
  li.textContent = when(e.at) + "  " + e.kind + "  " + (e.sandbox_id || "") + "  " + (e.backend || "") + "  "
    + (e.image || "") + (e.reason ? "  (" + e.reason + ")" : "");
  li.className = e.kind === "create_failed" || e.kind === "expired" ? "bad" : "";
  list.prepend(li);
  while (list.children.length > 200) list.lastChild.remove();
}

// ----- main loop ---------------------------------------------------------------------------------------

async function poll() {
  const status = document.getElementById("status");
  try {
    const [health, overview, sandboxes, audit, images] = await Promise.all([
      api("/v1/health"), api("/v1/overview"), api("/v1/sandboxes?" + sandboxQuery()), api("/v1/audit?limit=30"),
      api("/v1/images").catch(() => []),
    ]);
    document.getElementById("identity").textContent = health.node + " · dsec " + health.version;
    renderOverview(overview);
    renderSandboxes(sandboxes);
    renderAudit(audit);
    renderImages(images);
    await refreshSandbox();
    await refreshTrajectory();
    status.textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.ready = "1";
  } catch (err) {
    status.textContent = String(err.message || err);
  }
}

function start() {
  token = readToken();
  document.getElementById("token-form").addEventListener("submit", ev => {
    ev.preventDefault();
    token = document.getElementById("token-input").value;
    localStorage.setItem("dsec-token", token);
    document.getElementById("token-form").hidden = true;
    poll();
  });
  for (const id of ["f-backend", "f-state", "f-image", "f-label", "f-job"]) {
    document.getElementById(id).addEventListener("input", poll);
  }
  poll();
  setInterval(poll, POLL_MS);
  followEvents();
}

start();
