// ftd dashboard, this node: the snapshot, its header, ranks and last failure (the scripts share one global scope; core.js is loaded first).
"use strict";

// -- this node ------------------------------------------------------------------------------
// Header, this node's tile and its ranks are drawn from one snapshot: the last poll while the
// daemon answers; once it said it stopped (`daemon_stopped` on the stream), that poll with the
// events that came after it, shown as final.

function snapshot() {
  return state.final ? state.final.status : state.status;
}

async function pollStatus() {
  if (state.final) return; // the daemon stopped: its last picture stays
  setTimeout(pollStatus, STATUS_EVERY_MS);
  let doc;
  try {
    doc = await api("GET", "/v1/status");
  } catch (error) {
    if (state.final) return;
    if (state.reachable) state.reachableAt = Date.now() / 1000;
    state.reachable = false;
    showBanner(explain(error));
    if (state.status) renderStatus();
    return;
  }
  if (state.final) return;
  state.status = doc;
  state.sincePoll = [];
  state.reachable = true;
  state.statusAt = performance.now();
  showBanner("");
  renderStatus();
}

// The last poll with what the stream said after it: the job's last picture.
function finalStatus(stopped) {
  const s = JSON.parse(JSON.stringify(state.status || { ranks: [] }));
  for (const event of state.sincePoll) {
    const d = event.data || {};
    if (event.kind === "state_changed" && typeof d.state === "string") {
      s.state = d.state;
      s.state_reason = d.reason;
    } else if (event.kind === "attempt_failed" && d.failure) {
      s.last_failure = d.failure;
    } else if (event.kind === "rank_exited") {
      const rank = (s.ranks || []).find((r) => r.global_rank === d.global_rank);
      if (rank) {
        rank.state = d.state ?? rank.state;
        rank.exit_code = d.exit_code ?? rank.exit_code;
      }
    }
  }
  if (typeof stopped.data.state === "string") s.state = stopped.data.state;
  for (const rank of s.ranks || []) {
    if (rank.state === "running" || rank.state === "starting") rank.state = "stopped";
  }
  return s;
}

function lastEvent(kind, test) {
  for (let i = state.events.length - 1; i >= 0; i -= 1) {
    const event = state.events[i];
    if (event.kind === kind && (!test || test(event))) return event;
  }
  return null;
}

function becameFinal(event) {
  if (state.final) return;
  const s = finalStatus(event);
  const failure = s.last_failure;
  const change = lastEvent("state_changed", (e) => (e.data || {}).state === s.state);
  const failed = TERMINAL.includes(s.state) && s.state !== "succeeded" && failure && failure.reason;
  // The failure's root cause as the job said it (its exception, its last stderr line), not
  // only the exit code: the final picture must name what went wrong.
  const said = failed ? lastLine(failure.cause || failure.exception) : "";
  const cause = (failed && (said ? `${failure.reason}: ${said}` : failure.reason)) ||
    (change && change.data.reason) || "";
  state.final = { status: s, time: event.time, cause };
  showBanner("");
  setStream(`the daemon stopped at ${clock(event.time)}`, false);
  renderStatus();
}

function renderStatus() {
  const s = snapshot();
  if (!s) return;
  $("job").textContent = `node ${s.node_id} · run ${s.run_id}`;
  const badge = $("state");
  const final = state.final;
  const stale = !final && !state.reachable;
  badge.textContent = final ? String(s.state).toUpperCase() : stale ? `${s.state}?` : s.state;
  badge.className = `badge ${stale ? "s-init" : stateClass(s.state)}`;
  badge.dataset.final = final ? "1" : "";
  const note = $("final");
  if (final) {
    note.textContent = `final: the daemon stopped at ${clock(final.time)}` +
      (final.cause ? ` · ${final.cause}` : "");
  } else if (stale) {
    note.textContent = `last known state: the daemon has not answered since ${clock(state.reachableAt)}`;
  }
  note.hidden = !final && !stale;
  note.className = final ? `final ${stateClass(s.state)}` : "final";
  const policy = s.policy || {};
  const facts = [
    ["attempt", s.attempt],
    ["round", s.round],
    ["restarts used", `${s.restart_count}/${policy.max_restarts ?? s.max_restarts}`],
    ["nodes", `${policy.nnodes_min}–${policy.nnodes_max}`],
    ["uptime", duration(s.uptime_s)],
    ["pid", s.pid],
    ...progressFacts(s.progress),
    ...checkpointFacts(s.checkpoint),
    ...otherFacts(s),
  ];
  const box = $("facts");
  box.replaceChildren(...facts.map(([k, v]) => {
    const span = el("span", null, `${k} `);
    span.appendChild(el("b", null, v));
    return span;
  }), $("backoff"));
  state.nodes.add(String(s.node_id));
  renderWaiting(s.waiting, s.connecting, final);
  renderFailure(s);
  renderRanks(s);
  renderSelfTile(s);
  renderExcludeForm(s);
  renderTimeouts();
  renderTimeline();
}

// The status fields this page shows in its own way, or leaves out on purpose (the socket's
// counters, the policy's copies); any other the daemon reports is shown as a plain fact (its
// `reason` where it has one), so a new field needs no change here.
const SHOWN_FIELDS = new Set([
  "node_id", "run_id", "state", "attempt", "round", "restart_count", "max_restarts", "pid",
  "policy", "uptime_s", "progress", "checkpoint", "waiting", "connecting",
  "last_failure", "ranks", "timeouts", "progress_deadlines", "backoff_s", "backoff_left_s",
  "fast_failures", "restart_policy", "ipc", "last_recovery",
]);

function otherFacts(s) {
  return Object.entries(s)
    .filter(([name, value]) => !SHOWN_FIELDS.has(name) && value !== null && value !== undefined)
    .slice(0, 32)
    .map(([name, value]) => {
      const said = typeof value === "object" && typeof value.reason === "string" ? value.reason : value;
      const text = typeof said === "object" ? JSON.stringify(said) : String(said);
      return [name.replaceAll("_", " "), text.length > 200 ? `${text.slice(0, 199)}…` : text];
    });
}

// The memory tier (docs/checkpoint.md): the step a restart resumes after, and the steps the
// ranks finished that restores did not keep; with replicas, the peer that holds this node's
// and how many steps it is behind; with --checkpoint-every, the interval; none before a rank
// used it.
function checkpointFacts(memory) {
  if (!memory || typeof memory !== "object") return [];
  const newest = typeof memory.newest_step === "number" ? `step ${memory.newest_step}` : "–";
  const facts = [
    ["snapshot", newest],
    ["steps lost", memory.steps_lost ?? "–"],
  ];
  if (memory.every === "auto" || (typeof memory.every === "number" && memory.every > 1)) {
    const steps = memory.every === "auto" ? memory.interval_steps : memory.every;
    const auto = memory.every === "auto" ? " (auto)" : "";
    facts.push(["snapshot every", `${typeof steps === "number" ? steps : "–"} steps${auto}`]);
  }
  const replica = memory.replica;
  if (replica && typeof replica === "object") {
    const lag = typeof memory.replica_lag_steps === "number" ? `${memory.replica_lag_steps} steps behind` : "–";
    facts.push(["replica", `${replica.successor ?? "–"} · ${lag}`]);
  }
  return facts;
}

function renderRanks(s) {
  const ranks = s.ranks || [];
  const running = ranks.filter((r) => r.state === "running").length;
  $("ranks-summary").textContent = `${running}/${ranks.length} running`;
  const live = !state.final && state.reachable;
  $("ranks").classList.toggle("last-known", !state.final && !state.reachable);
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
    const alive = live && rank.state === "running";
    const heartbeat = el("td", "age heartbeat");
    heartbeat.dataset.base = alive || rank.state === "running" ? rank.last_heartbeat_age_s ?? "" : "";
    heartbeat.dataset.live = alive ? "1" : "";
    const section = el("td", null, rank.section ?? "–");
    const open = el("td", "age section");
    open.dataset.base = rank.section && heartbeat.dataset.base !== "" ? rank.section_age_s ?? "" : "";
    open.dataset.live = heartbeat.dataset.live;
    open.dataset.section = rank.section ?? "";
    const progress = rank.progress || {};
    // The time counted against the deadline that judges the rank (docs/api.md, "Progress").
    const stalled = el("td", "age progress-age");
    const limit = progress.progress_deadline_s;
    stalled.dataset.base = typeof limit === "number" ? progress.progress_deadline_age_s ?? "" : "";
    stalled.dataset.live = typeof limit === "number" && alive ? "1" : "";
    stalled.dataset.limit = typeof limit === "number" ? limit : "";
    stalled.dataset.deadline = progress.progress_deadline_name ?? "";
    row.append(heartbeat, section, open, stalled, el("td", "steps", Number.isInteger(progress.steps) ?
      progress.steps : "–"), el("td", "step-time", duration(progress.step_time_s)),
      stragglerCell(progress));
    return row;
  }));
  tickAges();
}

// The deadline an age runs against: the heartbeat timeout, the open section's, or the one
// that judges the rank's progress.
function deadlineOf(cell, timeouts) {
  if (cell.classList.contains("progress-age")) return Number(cell.dataset.limit);
  if (cell.classList.contains("heartbeat")) return timeouts.rank_heartbeat_timeout;
  const sections = timeouts.rank_section_timeouts || {};
  return sections[cell.dataset.section];
}

// Ages move between polls: the polled age plus the time since the poll.
function tickAges() {
  tickBackoff();
  const s = snapshot();
  if (!s) return;
  const since = (performance.now() - state.statusAt) / 1000;
  const timeouts = s.timeouts || {};
  for (const cell of document.querySelectorAll("#ranks td.age")) {
    if (cell.dataset.base === "") {
      cell.textContent = "–";
      cell.classList.remove("near", "stale");
      continue;
    }
    const age = Number(cell.dataset.base) + (cell.dataset.live ? since : 0);
    cell.textContent = `${age.toFixed(1)} s`;
    const limit = deadlineOf(cell, timeouts);
    const share = typeof limit === "number" && limit > 0 ? age / limit : 0;
    const [near, late] = cell.classList.contains("progress-age") ?
      [PROGRESS_NEAR, PROGRESS_LATE] : [NEAR_DEADLINE, 1];
    cell.classList.toggle("stale", share > late);
    cell.classList.toggle("near", share > near && share <= late);
    if (cell.dataset.deadline) {
      const what = cell.dataset.deadline === "progress" ? "" : ` in ${cell.dataset.deadline}`;
      cell.textContent += ` / ${duration(limit)}${what}`;
    }
    cell.title = typeof limit === "number" ? `${Math.round(share * 100)} % of its ${duration(limit)} deadline` : "";
  }
}

// The crash-loop back-off in progress: the time left before the next attempt.
function tickBackoff() {
  const box = $("backoff");
  const s = snapshot();
  const wait = lastEvent("restart_backoff");
  const started = lastEvent("attempt_started");
  let left = null;
  if (!state.final && s && s.state === "restarting" && wait && (!started || started.id < wait.id)) {
    left = wait.time + Number(wait.data.delay_s) - Date.now() / 1000;
  }
  box.hidden = left === null;
  if (left !== null) {
    box.textContent = `back-off: next attempt in ${duration(Math.max(0, left))} ` +
      `(${wait.data.fast_failures} fast failure${wait.data.fast_failures === 1 ? "" : "s"} in a row)`;
  }
}

function lastLine(text) {
  const lines = String(text || "").split("\n").map((line) => line.trim()).filter(Boolean);
  return lines.length ? lines[lines.length - 1] : "";
}

// The stacks/stderr box shows what was read for the failure shown: a newer failure clears it.
function clearCause() {
  causeShown = null;
  $("cause-text").hidden = true;
  $("cause-text").textContent = "";
  $("cause-token").hidden = true;
}

// The last failure: its reason, its cause as the job said it (the exception the rank's error
// file names, else its last stderr lines), and its stacks and stderr one click away (read
// through the API, shown as text).
function renderFailure(s) {
  const box = $("failure");
  const failure = s.last_failure;
  box.hidden = !failure;
  if (!failure) return;
  const said = failure.cause || failure.exception;
  const key = `${failure.timestamp}|${failure.reason}|${said || ""}`;
  if (box.dataset.key === key) return;
  const newFailure = !(box.dataset.key || "").startsWith(`${failure.timestamp}|${failure.reason}|`);
  box.dataset.key = key;
  if (newFailure) clearCause();
  // The attempt that failed, read at the click: the events may come after the status.
  const attemptOf = () => {
    const failed = lastEvent("attempt_failed", (e) => ((e.data || {}).failure || {}).timestamp === failure.timestamp);
    return failed ? failed.data.attempt : s.attempt;
  };
  const parts = [el("b", null, "last failure "), el("span", "reason", failure.reason)];
  if (said) parts.push(el("div", "exception", said));
  const rank = failure.global_rank;
  if (Number.isInteger(rank)) {
    const links = el("div", "links");
    for (const [what, path] of [["stacks", "stacks"], ["stderr", "stderr?tail_bytes=16384&"]]) {
      const button = el("button", `show-${what}`, `rank ${rank} ${what}`);
      button.type = "button";
      const sep = path.includes("?") ? "" : "?";
      button.addEventListener("click", () => {
        const attempt = attemptOf();
        showCause(`/v1/ranks/${rank}/${path}${sep}attempt=${attempt}`, `rank ${rank} ${what} (attempt ${attempt})`, button);
      });
      links.appendChild(button);
    }
    parts.push(links);
  }
  box.replaceChildren(...parts);
}

// A rank's stacks and stderr are privileged reads (the token even on loopback: what a job
// prints may hold its secrets). A 401 or 403 asks for the token beside the text, keeps it as
// the header's form does, and reads again with it.
let causeShown = null;

async function showCause(path, title, button) {
  causeShown = { path, title, button };
  const pre = $("cause-text");
  $("cause-token").hidden = true;
  pre.hidden = false;
  pre.textContent = `${title}: loading…`;
  try {
    const response = await fetch(path, { headers: headers({ Accept: "text/plain" }), cache: "no-store" });
    if (!response.ok) throw await problemOf(response);
    const text = await response.text();
    pre.textContent = `${title}\n\n${text || "(empty)"}`;
  } catch (error) {
    if (error instanceof Problem && (error.status === 401 || error.status === 403)) {
      pre.textContent = error.status === 401
        ? `${title}: a rank's output is shown only with the API token`
        : `${title}: that token is not this daemon's API token`;
      $("cause-token").hidden = false;
      $("cause-token-input").focus();
      return;
    }
    if (error instanceof Problem && error.status === 404 && path.includes("/stderr")) {
      // No file: `ftd serve` ran without -r/-t, so the rank wrote to its terminal.
      const where = "not captured (ftd serve without -r/-t): it is on the terminal of ftd serve";
      pre.textContent = `${title}: ${where}`;
      if (button) {
        button.textContent = `${title.split(" (")[0]}: on the terminal of ftd serve`;
        button.disabled = true;
      }
      return;
    }
    pre.textContent = `${title}: ${error instanceof Problem ? error.message : explain(error)}`;
  }
}

function wireCauseToken() {
  $("cause-token").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("cause-token-input").value.trim();
    $("cause-token-input").value = "";
    if (!value || !causeShown) return;
    setToken(value);
    showCause(causeShown.path, causeShown.title, causeShown.button);
  });
}

// Exclusion needs the multi-node rendezvous: no form where it always fails.
function renderExcludeForm(s) {
  const policy = s.policy || {};
  const multi = policy.multi_node ?? (Number(policy.nnodes_max) > 1);
  $("exclude-form").hidden = !multi;
  $("exclude-note").hidden = Boolean(multi);
}

// The tuning form has one input per timeout the daemon reports, made the first time it does.
function timeoutInputs(timeouts) {
  const form = $("timeouts-form");
  const submit = form.querySelector("button[type=submit]");
  for (const [name, value] of Object.entries(timeouts)) {
    if ($(`t-${name}`)) continue;
    const input = el("input");
    input.id = `t-${name}`;
    if (isTimeoutMap(value)) input.placeholder = "setup:600,step:180";
    else input.inputMode = "decimal";
    const label = el("label", null, `${timeoutLabel(name)} `);
    label.appendChild(input);
    form.insertBefore(label, submit);
  }
}

function renderTimeouts() {
  const t = state.status.timeouts;
  const box = $("timeouts");
  if (!t) {
    box.textContent = "timeouts: rank health is off";
    return;
  }
  box.replaceChildren(el("span", null, "timeouts in force: "), ...Object.entries(t).map(
    ([k, v]) => {
      const span = el("span", null, `${timeoutLabel(k)} `);
      span.appendChild(el("b", null, seconds(v)));
      span.append("  ");
      return span;
    },
  ), ...progressDeadlines(state.status.progress_deadlines));
  timeoutInputs(t);
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
