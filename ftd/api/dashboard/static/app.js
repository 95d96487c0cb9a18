// ftd dashboard: plain JavaScript, no dependencies. Reads the REST API of the daemon that
// served this page; acts with the bearer token typed into the page (sessionStorage only).
// Everything from the daemon is shown with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "ftd-token";
const STAGES = ["detect", "stop", "rendezvous", "spawn", "first_step"];
const STATUS_EVERY_MS = 1000;
const CLUSTER_EVERY_MS = 2000;
const BACKLOG = 2000;
const EVENTS_KEPT = 5000;
const EVENTS_SHOWN = 400;
const RETRY_MS = 2000;

const $ = (id) => document.getElementById(id);
const state = {
  status: null,
  statusAt: 0,
  cluster: null,
  tiles: new Map(),
  events: [],
  lastId: 0,
  kinds: new Set(),
  nodes: new Set(),
  timeoutsDirty: false,
};
// For tests and the curious: render times, counters.
const probe = { clusterRenderMs: [], eventsSeen: 0, streamLive: false, loaded: false };
window.__ftd = probe;

// -- the API --------------------------------------------------------------------------------

class Problem extends Error {
  constructor(status, title, detail) {
    super(detail ? `${status} ${title}: ${detail}` : `${status} ${title}`);
    this.status = status;
  }
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

function headers(extra) {
  const out = { Accept: "application/json", ...extra };
  if (token()) out.Authorization = `Bearer ${token()}`;
  return out;
}

async function problemOf(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return new Problem(response.status, body.title || response.statusText, body.detail || "");
  } catch (_) {
    return new Problem(response.status, response.statusText, text.slice(0, 200));
  }
}

async function api(method, path, body) {
  const init = { method, headers: headers(), cache: "no-store" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await problemOf(response);
  return response.json();
}

// -- small helpers --------------------------------------------------------------------------

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function clock(seconds) {
  const d = new Date(seconds * 1000);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function clockMs(seconds) {
  return `${clock(seconds)}.${String(Math.floor((seconds % 1) * 1000)).padStart(3, "0")}`;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
  if (seconds < 7200) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function seconds(value) {
  if (value === null || value === undefined) return "off";
  if (typeof value === "object") {
    const parts = Object.entries(value).map(([k, v]) => `${k}:${seconds(v)}`);
    return parts.join(",") || "none";
  }
  return String(value);
}

function stateClass(name) {
  const known = ["init", "rendezvous", "running", "restarting", "stopping", "succeeded",
    "failed", "stopped"];
  return known.includes(name) ? `s-${name}` : "s-init";
}

function showBanner(text) {
  const banner = $("banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}

function explain(error) {
  if (error instanceof Problem && error.status === 401) {
    return "this daemon needs the API token for reads too (it listens on a non-loopback " +
      "address): enter it above";
  }
  if (error instanceof Problem) return error.message;
  return `cannot reach the daemon: ${error.message}`;
}

// -- this node ------------------------------------------------------------------------------

async function pollStatus() {
  setTimeout(pollStatus, STATUS_EVERY_MS);
  try {
    state.status = await api("GET", "/v1/status");
  } catch (error) {
    showBanner(explain(error));
    return;
  }
  state.statusAt = performance.now();
  showBanner("");
  renderStatus();
}

function renderStatus() {
  const s = state.status;
  $("job").textContent = `node ${s.node_id} · run ${s.run_id}`;
  const badge = $("state");
  badge.textContent = s.state;
  badge.className = `badge ${stateClass(s.state)}`;
  const policy = s.policy || {};
  const facts = [
    ["attempt", s.attempt],
    ["round", s.round],
    ["restarts", `${s.restart_count}/${policy.max_restarts ?? s.max_restarts}`],
    ["nodes", `${policy.nnodes_min}–${policy.nnodes_max}`],
    ["uptime", duration(s.uptime_s)],
    ["pid", s.pid],
  ];
  if (s.last_failure) facts.push(["last failure", s.last_failure.reason]);
  const box = $("facts");
  box.replaceChildren(...facts.map(([k, v]) => {
    const span = el("span", null, `${k} `);
    span.appendChild(el("b", null, v));
    return span;
  }));
  state.nodes.add(String(s.node_id));
  renderRanks();
  renderTimeouts();
  renderTimeline();
}

function renderRanks() {
  const ranks = state.status.ranks || [];
  const running = ranks.filter((r) => r.state === "running").length;
  $("ranks-summary").textContent = `${running}/${ranks.length} running`;
  const body = $("ranks").tBodies[0];
  body.replaceChildren(...ranks.map((rank) => {
    const row = el("tr");
    row.dataset.rank = rank.global_rank;
    row.append(
      el("td", null, rank.local_rank),
      el("td", null, rank.global_rank),
      el("td", null, rank.pid ?? "–"),
      el("td", `state ${stateClass(rank.state)}`, rank.state),
      el("td", null, rank.exit_code ?? ""),
    );
    const heartbeat = el("td", "age");
    heartbeat.dataset.base = rank.last_heartbeat_age_s ?? "";
    heartbeat.dataset.live = rank.state === "running" ? "1" : "";
    const section = el("td", null, rank.section ?? "–");
    const open = el("td", "age");
    open.dataset.base = rank.section ? rank.section_age_s ?? "" : "";
    open.dataset.live = heartbeat.dataset.live;
    row.append(heartbeat, section, open);
    return row;
  }));
  tickAges();
}

// Ages move between polls: the polled age plus the time since the poll.
function tickAges() {
  if (!state.status) return;
  const since = (performance.now() - state.statusAt) / 1000;
  const limit = (state.status.timeouts || {}).rank_heartbeat_timeout;
  for (const cell of document.querySelectorAll("#ranks td.age")) {
    if (cell.dataset.base === "") {
      cell.textContent = "–";
      continue;
    }
    const age = Number(cell.dataset.base) + (cell.dataset.live ? since : 0);
    cell.textContent = `${age.toFixed(1)} s`;
    cell.classList.toggle("stale", Boolean(limit) && age > limit);
  }
}

function renderTimeouts() {
  const t = state.status.timeouts;
  const box = $("timeouts");
  if (!t) {
    box.textContent = "timeouts: rank health is off";
    return;
  }
  const names = {
    initial_rank_heartbeat_timeout: "first heartbeat",
    rank_heartbeat_timeout: "heartbeat",
    rank_section_timeouts: "sections",
    rank_out_of_section_timeout: "out of section",
  };
  box.replaceChildren(el("span", null, "timeouts in force: "), ...Object.entries(t).map(
    ([k, v]) => {
      const span = el("span", null, `${names[k] || k} `);
      span.appendChild(el("b", null, seconds(v)));
      span.append("  ");
      return span;
    },
  ));
  if (!state.timeoutsDirty) {
    for (const [name, value] of Object.entries(t)) {
      const input = $(`t-${name}`);
      if (input && document.activeElement !== input) {
        if (value === null) input.value = "";
        else if (typeof value === "object") input.value = Object.keys(value).length ? seconds(value) : "";
        else input.value = value;
      }
    }
  }
}

// -- the cluster ----------------------------------------------------------------------------

async function pollCluster() {
  try {
    state.cluster = await api("GET", "/v1/cluster");
  } catch (error) {
    $("cluster-summary").textContent = explain(error);
    return;
  } finally {
    setTimeout(pollCluster, CLUSTER_EVERY_MS);
  }
  renderCluster();
}

function rankCounts(node) {
  if (Number.isInteger(node.ranks_running) && Number.isInteger(node.ranks_total)) {
    return `${node.ranks_running}/${node.ranks_total} up`;
  }
  if (Array.isArray(node.ranks)) {
    const up = node.ranks.filter((r) => r.state === "running").length;
    return `${up}/${node.ranks.length} up`;
  }
  if (Number.isInteger(node.nproc_per_node)) return `${node.nproc_per_node} ranks`;
  return "ranks ?";
}

function renderCluster() {
  const started = performance.now();
  const c = state.cluster;
  const excluded = new Map();
  for (const entry of c.excluded || []) {
    if (typeof entry === "string") excluded.set(entry, "");
    else if (entry && entry.node_id !== undefined) excluded.set(String(entry.node_id), entry.reason || "");
  }
  const nodes = (c.nodes || []).filter((n) => n && n.node_id !== undefined);
  const known = new Set(nodes.map((n) => String(n.node_id)));
  for (const id of excluded.keys()) {
    if (!known.has(id)) nodes.push({ node_id: id, state: "stopped" });
  }
  const self = state.status ? String(state.status.node_id) : "";
  const counts = new Map();
  const fragment = document.createDocumentFragment();
  const seen = new Set();
  for (const node of nodes) {
    const id = String(node.node_id);
    seen.add(id);
    state.nodes.add(id);
    const isExcluded = excluded.has(id);
    const stateName = String(node.state);
    counts.set(isExcluded ? "excluded" : stateName, (counts.get(isExcluded ? "excluded" : stateName) || 0) + 1);
    const round = node.round ?? node.attempt ?? "–";
    const nodeRank = node.group_rank ?? node.node_rank ?? "–";
    const lines = [id, `${stateName} · round ${round}`,
      nodeRank === "–" ? rankCounts(node) : `rank ${nodeRank} · ${rankCounts(node)}`];
    const signature = `${lines.join("|")}|${isExcluded}|${excluded.get(id)}|${node.last_failure ?? ""}|${id === self}`;
    let tile = state.tiles.get(id);
    if (!tile) {
      const box = el("div", "tile");
      box.setAttribute("role", "listitem");
      box.dataset.node = id;
      tile = { box, name: el("div", "name"), line1: el("div", "meta"), line2: el("div", "meta"), signature: "" };
      box.append(tile.name, tile.line1, tile.line2);
      box.addEventListener("click", () => { $("exclude-node").value = id; });
      state.tiles.set(id, tile);
      fragment.appendChild(box);
    }
    if (tile.signature !== signature) {
      tile.signature = signature;
      tile.box.className = `tile ${stateClass(stateName)}${isExcluded ? " excluded" : ""}${id === self ? " self" : ""}`;
      tile.box.dataset.state = stateName;
      tile.name.textContent = lines[0];
      tile.line1.textContent = isExcluded ? `excluded · ${stateName}` : lines[1];
      tile.line2.textContent = lines[2];
      const failure = node.last_failure ? `\nlast failure: ${typeof node.last_failure === "string" ? node.last_failure : node.last_failure.reason}` : "";
      tile.box.title = `${id}\n${lines[1]}\n${lines[2]}${isExcluded ? `\nexcluded: ${excluded.get(id)}` : ""}${failure}`;
    }
  }
  $("tiles").appendChild(fragment);
  for (const [id, tile] of state.tiles) {
    if (!seen.has(id)) {
      tile.box.remove();
      state.tiles.delete(id);
    }
  }
  const countBox = $("cluster-counts");
  countBox.replaceChildren(...[...counts.entries()].sort().map(([name, n]) => {
    const chip = el("span", `count ${name === "excluded" ? "" : stateClass(name)}`, `${n} ${name}`);
    if (name === "excluded") chip.style.background = "var(--excluded)";
    return chip;
  }));
  const round = c.round || {};
  $("cluster-summary").textContent =
    `${nodes.length} node${nodes.length === 1 ? "" : "s"} · round ${round.round ?? "–"} · ` +
    `${(round.members || []).length} members · ${excluded.size} excluded`;
  const list = $("node-ids");
  if (list.childElementCount !== state.nodes.size) {
    list.replaceChildren(...[...state.nodes].sort().map((id) => { const o = el("option"); o.value = id; return o; }));
  }
  refreshNodeFilter();
  probe.clusterRenderMs.push(performance.now() - started);
  if (probe.clusterRenderMs.length > 50) probe.clusterRenderMs.shift();
}

// -- events ---------------------------------------------------------------------------------

function nodeOf(event) {
  const data = event.data || {};
  if (typeof data.node_id === "string") return data.node_id;
  return state.status ? String(state.status.node_id) : "";
}

const SUMMARY_KEYS = {
  state_changed: ["previous", "state", "reason"],
  attempt_started: ["attempt", "pids"],
  attempt_failed: ["attempt"],
  rank_exited: ["attempt", "global_rank", "pid", "exit_code", "state"],
  rank_hung: ["global_rank", "reason"],
  restart_requested: ["scope", "reason", "by", "counted"],
  recovery: ["attempt", "cause", "total_s"],
  timeouts_changed: ["by"],
  round_closed: ["round", "members", "group_rank"],
};

function summary(event) {
  const data = event.data || {};
  if (event.kind === "attempt_failed" && data.failure) return `attempt=${data.attempt} ${data.failure.reason}`;
  const keys = SUMMARY_KEYS[event.kind] || Object.keys(data);
  return keys
    .filter((k) => data[k] !== undefined && data[k] !== null)
    .map((k) => `${k}=${typeof data[k] === "object" ? JSON.stringify(data[k]) : data[k]}`)
    .join(" ");
}

function eventLine(event) {
  const item = el("li", `k-${String(event.kind).replace(/[^a-z0-9_]/gi, "")}`);
  item.dataset.id = event.id;
  item.append(el("span", "time", clockMs(event.time)), el("span", "kind", event.kind));
  const node = nodeOf(event);
  if (state.nodes.size > 1 && node) item.append(el("span", "muted", `[${node}] `));
  item.append(el("span", null, summary(event)));
  item.title = JSON.stringify(event.data);
  return item;
}

function matches(event) {
  const kind = $("filter-kind").value;
  const node = $("filter-node").value;
  const text = $("filter-text").value.trim().toLowerCase();
  if (kind && event.kind !== kind) return false;
  if (node && nodeOf(event) !== node) return false;
  if (text && !`${event.kind} ${JSON.stringify(event.data)}`.toLowerCase().includes(text)) return false;
  return true;
}

function addEvent(event, live) {
  if (!event || typeof event.id !== "number" || event.id <= state.lastId) return;
  state.lastId = event.id;
  state.events.push(event);
  if (state.events.length > EVENTS_KEPT) state.events.splice(0, state.events.length - EVENTS_KEPT);
  probe.eventsSeen += 1;
  if (!state.kinds.has(event.kind)) {
    state.kinds.add(event.kind);
    const option = el("option", null, event.kind);
    option.value = event.kind;
    const select = $("filter-kind");
    const after = [...select.options].slice(1).find((o) => o.value > event.kind);
    select.insertBefore(option, after || null);
  }
  const node = nodeOf(event);
  if (node) state.nodes.add(node);
  if (live) {
    if (matches(event)) {
      const list = $("events");
      list.insertBefore(eventLine(event), list.firstChild);
      while (list.childElementCount > EVENTS_SHOWN) list.lastChild.remove();
    }
    if (["attempt_started", "recovery", "attempt_failed", "workers_stopped", "daemon_stopped"].includes(event.kind)) {
      renderTimeline();
    }
  }
}

function renderEvents() {
  const shown = [];
  for (let i = state.events.length - 1; i >= 0 && shown.length < EVENTS_SHOWN; i -= 1) {
    if (matches(state.events[i])) shown.push(eventLine(state.events[i]));
  }
  $("events").replaceChildren(...shown);
}

function refreshNodeFilter() {
  const select = $("filter-node");
  if (select.options.length - 1 === state.nodes.size) return;
  const chosen = select.value;
  const options = [...state.nodes].sort().map((id) => { const o = el("option", null, id); o.value = id; return o; });
  select.replaceChildren(select.options[0], ...options);
  select.value = chosen;
}

async function loadBacklog() {
  const head = await api("GET", "/v1/events?limit=1");
  const since = Math.max(0, head.last_id - BACKLOG);
  const page = await api("GET", `/v1/events?since=${since}&limit=${BACKLOG}`);
  for (const event of page.events) addEvent(event, false);
  renderEvents();
  renderTimeline();
}

function setStream(text, live) {
  $("stream-state").textContent = text;
  probe.streamLive = live;
}

function sseBlock(block) {
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  try {
    addEvent(JSON.parse(data.join("\n")), true);
  } catch (_) {
    // a malformed message is skipped; the next one carries on
  }
}

// Server-sent events through fetch (EventSource cannot send the Authorization header).
async function stream() {
  for (;;) {
    try {
      const response = await fetch(`/v1/events?since=${state.lastId}`, {
        headers: headers({ Accept: "text/event-stream", "Last-Event-ID": String(state.lastId) }),
        cache: "no-store",
      });
      if (!response.ok) throw await problemOf(response);
      setStream("live", true);
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          sseBlock(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
      setStream("the daemon closed the stream; reconnecting…", false);
    } catch (error) {
      setStream(`disconnected (${explain(error)}); retrying…`, false);
    }
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

// -- the recovery timeline ------------------------------------------------------------------

function attemptsFromEvents() {
  const attempts = [];
  let ended = null;
  const failed = new Map();
  for (const event of state.events) {
    const data = event.data || {};
    if (event.kind === "attempt_started") {
      if (attempts.length && attempts[attempts.length - 1].end === null) {
        attempts[attempts.length - 1].end = event.time;
      }
      attempts.push({ attempt: data.attempt, start: event.time, end: null });
      ended = null;
    } else if (event.kind === "attempt_failed") {
      failed.set(data.attempt, (data.failure && data.failure.kind) || "exit");
    } else if (event.kind === "daemon_stopped" || (event.kind === "workers_stopped" && ended === null)) {
      ended = event.time;
      if (attempts.length && attempts[attempts.length - 1].end === null && event.kind === "daemon_stopped") {
        attempts[attempts.length - 1].end = event.time;
      }
    }
  }
  const terminal = state.status && ["succeeded", "failed", "stopped"].includes(state.status.state);
  if (terminal && attempts.length && attempts[attempts.length - 1].end === null && ended !== null) {
    attempts[attempts.length - 1].end = ended;
  }
  return { attempts, failed };
}

function renderTimeline() {
  const { attempts, failed } = attemptsFromEvents();
  const recoveries = state.events.filter((e) => e.kind === "recovery");
  const now = Date.now() / 1000;
  const box = $("attempts");
  const axis = $("axis");
  if (!attempts.length) {
    box.replaceChildren(el("span", "muted", " no attempt yet"));
    axis.replaceChildren();
  } else {
    const t0 = attempts[0].start;
    const t1 = Math.max(now, ...attempts.map((a) => a.end || now));
    const span = Math.max(t1 - t0, 1e-3);
    box.replaceChildren(...attempts.map((a, i) => {
      const last = i === attempts.length - 1;
      const end = a.end ?? now;
      let kind = "s-running";
      if (failed.has(a.attempt)) kind = failed.get(a.attempt) === "request" ? "s-restarting" : "s-failed";
      else if (!last) kind = "s-restarting";
      else if (state.status) kind = stateClass(state.status.state);
      const bar = el("div", `attempt ${kind}`, `attempt ${a.attempt}`);
      bar.dataset.attempt = a.attempt;
      bar.style.left = `${((a.start - t0) / span) * 100}%`;
      bar.style.width = `max(4px, ${((end - a.start) / span) * 100}%)`;
      bar.title = `attempt ${a.attempt}: ${clock(a.start)} – ${a.end ? clock(a.end) : "now"} (${duration(end - a.start)})`;
      return bar;
    }));
    axis.replaceChildren(el("span", null, clock(t0)), el("span", null, duration(span)), el("span", null, clock(t1)));
  }
  const restarts = Math.max(0, attempts.length - 1);
  $("timeline-summary").textContent =
    `${attempts.length} attempt${attempts.length === 1 ? "" : "s"} · ${restarts} restart${restarts === 1 ? "" : "s"}` +
    (recoveries.length ? ` · last recovery ${duration(recoveries[recoveries.length - 1].data.total_s)}` : "");
  renderRecoveries(recoveries, restarts);
}

function renderRecoveries(recoveries, restarts) {
  const rows = recoveries.slice(-20).reverse().map((event) => {
    const d = event.data || {};
    const row = el("div", "recovery");
    row.dataset.attempt = d.attempt;
    row.append(el("div", "label", `attempt ${d.attempt} · ${d.cause ?? "restart"}`));
    row.lastChild.title = String(d.cause ?? "");
    const bar = el("div", "stages");
    const stages = d.stages || {};
    for (const name of STAGES) {
      const value = Number(stages[name]);
      if (!Number.isFinite(value) || value < 0) continue;
      const part = el("div", `stage stage-${name}`, `${name} ${duration(value)}`);
      part.style.flexGrow = String(Math.max(value, 1e-4));
      part.title = `${name}: ${duration(value)}`;
      bar.appendChild(part);
    }
    row.append(bar, el("div", "total", duration(Number(d.total_s))));
    return row;
  });
  if (!recoveries.length && restarts) {
    rows.push(el("div", "muted", `${restarts} restart${restarts === 1 ? "" : "s"}; this daemon reports no stage breakdown (recovery events) yet`));
  }
  const legend = el("div", "legend");
  for (const name of STAGES) {
    const key = el("span", null, name);
    key.style.setProperty("--k", `var(--${name === "rendezvous" ? "rdzv" : name})`);
    legend.appendChild(key);
  }
  $("recoveries").replaceChildren(...rows, legend);
}

// -- actions --------------------------------------------------------------------------------

function showResult(kind, text) {
  const box = $("action-result");
  box.className = `result ${kind}`;
  box.textContent = text;
}

function confirmAction(text) {
  const dialog = $("confirm");
  $("confirm-text").textContent = text;
  return new Promise((resolve) => {
    const finish = (answer) => (event) => {
      event.preventDefault();
      $("confirm-ok").onclick = null;
      $("confirm-cancel").onclick = null;
      dialog.onclose = null;
      dialog.close();
      resolve(answer);
    };
    $("confirm-ok").onclick = finish(true);
    $("confirm-cancel").onclick = finish(false);
    dialog.onclose = () => resolve(false);
    dialog.showModal();
  });
}

async function act(what, question, perform) {
  if (!token()) {
    showResult("error", `${what}: refused — this action needs the API token; enter it above`);
    return;
  }
  if (!(await confirmAction(question))) {
    showResult("", `${what}: cancelled`);
    return;
  }
  showResult("", `${what}: sending…`);
  try {
    const answer = await perform();
    const id = answer && answer.event_id ? ` (event ${answer.event_id})` : "";
    showResult("ok", `${what}: done${id}`);
  } catch (error) {
    showResult("error", `${what}: ${error instanceof Problem ? error.message : explain(error)}`);
  }
}

function parseSeconds(name, raw) {
  const text = raw.trim();
  if (!text || ["none", "off", "null"].includes(text.toLowerCase())) return null;
  const value = Number(text);
  if (!Number.isFinite(value) || value <= 0) throw new Error(`${name}: expected seconds above 0 or empty, got ${JSON.stringify(text)}`);
  return value;
}

function parseSections(raw) {
  const sections = {};
  for (const item of raw.split(",").map((s) => s.trim()).filter(Boolean)) {
    const [name, value = ""] = item.split(":");
    if (!name.trim()) throw new Error(`sections: a section name is empty in ${JSON.stringify(item)}`);
    sections[name.trim()] = parseSeconds(`sections.${name.trim()}`, value);
  }
  return sections;
}

function timeoutsPatch() {
  const current = (state.status && state.status.timeouts) || {};
  const patch = {};
  for (const name of ["initial_rank_heartbeat_timeout", "rank_heartbeat_timeout", "rank_out_of_section_timeout"]) {
    const value = parseSeconds(name, $(`t-${name}`).value);
    if (value !== (current[name] ?? null)) patch[name] = value;
  }
  const sections = parseSections($("t-rank_section_timeouts").value);
  if (JSON.stringify(sections) !== JSON.stringify(current.rank_section_timeouts || {})) {
    patch.rank_section_timeouts = sections;
  }
  return patch;
}

function wireActions() {
  $("restart-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const reason = $("restart-reason").value.trim() || "operator request (dashboard)";
    const count = $("restart-count").checked;
    act("restart", `Restart every rank of the job? Reason: “${reason}”${count ? "" : " (not counted)"}`,
      () => api("POST", "/v1/restart", { scope: "cluster", reason, count }));
  });
  const nodePath = () => `/v1/nodes/${encodeURIComponent($("exclude-node").value.trim())}/exclude`;
  $("exclude-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const node = $("exclude-node").value.trim();
    const reason = $("exclude-reason").value.trim() || "operator request (dashboard)";
    act(`exclude ${node}`, `Exclude node “${node}” from the job? Its ranks stop and every node restarts.`,
      () => api("POST", nodePath(), { reason }));
  });
  $("readmit-button").addEventListener("click", () => {
    const node = $("exclude-node").value.trim();
    if (!node) {
      showResult("error", "readmit: enter a node id");
      return;
    }
    act(`readmit ${node}`, `Readmit node “${node}”?`, () => api("DELETE", nodePath()));
  });
  for (const input of document.querySelectorAll("#timeouts-form input")) {
    input.addEventListener("input", () => { state.timeoutsDirty = true; });
  }
  $("timeouts-form").addEventListener("submit", (event) => {
    event.preventDefault();
    let patch;
    try {
      patch = timeoutsPatch();
    } catch (error) {
      showResult("error", `timeouts: ${error.message}`);
      return;
    }
    if (!Object.keys(patch).length) {
      showResult("", "timeouts: nothing changed");
      return;
    }
    act("timeouts", `Change the timeouts in force? ${JSON.stringify(patch)}`, async () => {
      const answer = await api("PATCH", "/v1/timeouts", patch);
      state.timeoutsDirty = false;
      return answer;
    });
  });
}

function wireToken() {
  const refresh = () => {
    const has = Boolean(token());
    $("token-state").textContent = has ? "token set (this tab only)" : "no token: reads only";
    $("token-forget").hidden = !has;
  };
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    $("token").value = "";
    refresh();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    refresh();
  });
  refresh();
}

function wireFilters() {
  for (const id of ["filter-kind", "filter-node", "filter-text"]) {
    $(id).addEventListener("input", renderEvents);
  }
}

async function start() {
  wireToken();
  wireActions();
  wireFilters();
  setInterval(tickAges, 250);
  pollStatus();
  pollCluster();
  try {
    await loadBacklog();
  } catch (error) {
    showBanner(explain(error));
  }
  probe.loaded = true;
  stream();
}

document.addEventListener("DOMContentLoaded", start);
