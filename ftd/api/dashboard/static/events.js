// ftd dashboard, the event log, its stream and the recovery timeline (the scripts share one global scope; core.js is loaded first).
"use strict";

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
  job_culprit: ["round", "node_id", "rank", "victim", "reason"],
  restart_requested: ["scope", "reason", "by", "counted"],
  recovery: ["attempt", "cause", "total_s"],
  timeouts_changed: ["by"],
  round_closed: ["round", "members", "group_rank"],
};

const STACKS = /(?:Python|native) stacks in (\S+?);?(?:\s|$)/;

// Where a hang's stacks went, first: a one-line form cut at the window's edge still shows it.
function stacksOf(data) {
  const text = [data.reason, ...(Array.isArray(data.notes) ? data.notes : []),
    data.failure && data.failure.reason].filter((t) => typeof t === "string").join(" ");
  const match = STACKS.exec(text);
  return match ? `stacks=${match[1]} ` : "";
}

// What a timeouts change changed: the values before → after (before: the previous change).
function timeoutsChange(event) {
  const after = (event.data || {}).timeouts || {};
  const earlier = state.events.filter((e) => e.kind === "timeouts_changed" && e.id < event.id);
  const before = earlier.length ? (earlier[earlier.length - 1].data || {}).timeouts || {} : null;
  const parts = [];
  for (const [name, value] of Object.entries(after)) {
    const old = before ? before[name] : undefined;
    if (before && JSON.stringify(old) === JSON.stringify(value)) continue;
    parts.push(before ? `${name} ${seconds(old ?? null)} → ${seconds(value)}` : `${name} ${seconds(value)}`);
  }
  return `by=${event.data.by} ${parts.join(" ") || "no change"}`;
}

function summary(event) {
  const data = event.data || {};
  if (event.kind === "timeouts_changed") return timeoutsChange(event);
  if (event.kind === "rank_hung") return `global_rank=${data.global_rank} ${stacksOf(data)}${data.reason}`;
  if (event.kind === "attempt_failed" && data.failure) return `attempt=${data.attempt} ${stacksOf(data)}${data.failure.reason}`;
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
  if (live) state.sincePoll.push(event);
  if (event.kind === "daemon_stopped") becameFinal(event);
  if (["attempt_failed", "rank_hung"].includes(event.kind)) renderHistory();
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
  renderHistory();
  renderTimeline();
}

// Each node's failed attempts (an operator's restart request is none) and each rank's hangs,
// from the events: flaky hardware shows.
function renderHistory() {
  const byNode = new Map();
  const byRank = new Map();
  for (const event of state.events) {
    const data = event.data || {};
    if (event.kind === "attempt_failed" && (data.failure || {}).kind !== "request") {
      const node = nodeOf(event);
      byNode.set(node, (byNode.get(node) || 0) + 1);
    } else if (event.kind === "rank_hung" && data.global_rank !== undefined) {
      const key = `rank ${data.global_rank}`;
      byRank.set(key, (byRank.get(key) || 0) + 1);
    }
  }
  const box = $("history");
  if (!byNode.size && !byRank.size) {
    box.replaceChildren(el("span", "muted", "failure history: none"));
    return;
  }
  const plural = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
  const items = [...[...byNode.entries()].sort().map(([node, n]) => el("span", "node-failures", `node ${node}: ${plural(n, "failed attempt")}`)),
    ...[...byRank.entries()].sort().map(([rank, n]) => el("span", "rank-hangs", `${rank}: ${plural(n, "hang")}`))];
  box.replaceChildren(el("span", "muted", "failure history: "), ...items);
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
      if (state.final) return; // it said it stopped: nothing more will come
      setStream("the daemon closed the stream; reconnecting…", false);
    } catch (error) {
      if (state.final) return;
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
  const terminal = snapshot() && TERMINAL.includes(snapshot().state);
  if (terminal && attempts.length && attempts[attempts.length - 1].end === null && ended !== null) {
    attempts[attempts.length - 1].end = ended;
  }
  return { attempts, failed };
}

function renderTimeline() {
  const { attempts, failed } = attemptsFromEvents();
  const recoveries = state.events.filter((e) => e.kind === "recovery");
  const now = state.final ? state.final.time : Date.now() / 1000;
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
      else if (snapshot()) kind = stateClass(snapshot().state);
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
  // Every restart is drawn; the header counts those charged to --max-restarts (the CLI's
  // "restarts N/M used"): where they differ, say so.
  const shown = snapshot();
  const used = shown ? shown.restart_count : null;
  const uncounted = typeof used === "number" && used < restarts ?
    ` (${used} counted against --max-restarts)` : "";
  $("timeline-summary").textContent =
    `${attempts.length} attempt${attempts.length === 1 ? "" : "s"} · ${restarts} restart${restarts === 1 ? "" : "s"}${uncounted}` +
    (recoveries.length ? ` · last recovery ${duration(recoveries[recoveries.length - 1].data.total_s)}` : "");
  renderRecoveries(recoveries, restarts);
}

// A recovery's stages to scale (a stage's width is its share of the total; a narrow one keeps
// a sliver and its label in the row's caption); a stage not measured is "–", never 0, but
// restore and redo only show where the ranks restored a snapshot.
const AFTER_RESTORE = new Set(["restore", "redo"]);
const STAGE_COLOURS = { rendezvous: "rdzv", init: "s-init", restore: "s-restore", redo: "s-redo" };

function renderRecoveries(recoveries, restarts) {
  const rows = recoveries.slice(-20).reverse().map((event) => {
    const d = event.data || {};
    const row = el("div", "recovery");
    row.dataset.attempt = d.attempt;
    row.append(el("div", "label", `attempt ${d.attempt} · ${d.cause ?? "restart"}`));
    row.lastChild.title = String(d.cause ?? "");
    const bar = el("div", "stages");
    const stages = d.stages || {};
    const measured = STAGES.filter((name) => typeof stages[name] === "number" && stages[name] >= 0);
    const sum = measured.reduce((total, name) => total + stages[name], 0);
    const caption = el("div", "stage-values");
    for (const name of STAGES) {
      if (!(name in stages)) continue;
      const value = typeof stages[name] === "number" && stages[name] >= 0 ? stages[name] : null;
      if (value === null && AFTER_RESTORE.has(name)) continue;
      const text = `${name} ${duration(value)}`;
      caption.appendChild(el("span", `value-${name}`, text));
      if (value === null) continue;
      const part = el("div", `stage stage-${name}`, text);
      part.style.width = `${sum > 0 ? (value / sum) * 100 : 100 / measured.length}%`;
      part.dataset.seconds = String(value);
      part.title = text;
      bar.appendChild(part);
    }
    const total = typeof d.total_s === "number" ? d.total_s : null;
    const body = el("div", "stage-body");
    body.append(bar, caption);
    row.append(body, el("div", "total", duration(total)));
    return row;
  });
  if (!recoveries.length && restarts) {
    rows.push(el("div", "muted", `${restarts} restart${restarts === 1 ? "" : "s"}; this daemon reports no stage breakdown (recovery events) yet`));
  }
  const legend = el("div", "legend");
  for (const name of STAGES) {
    const key = el("span", null, name);
    key.style.setProperty("--k", `var(--${STAGE_COLOURS[name] ?? name})`);
    legend.appendChild(key);
  }
  $("recoveries").replaceChildren(...rows, legend);
}
