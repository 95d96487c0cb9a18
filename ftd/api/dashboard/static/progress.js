// ftd dashboard, progress: the node's pace in the header, the deadlines that judge the ranks'
// progress beside the timeouts in force (docs/api.md, "Progress"), and a forming round's: who
// joined, who is missing, the time left; node.js draws them.
"use strict";

// A progress age turns amber past half its deadline, red past 90 %: a hang verdict is near.
const PROGRESS_NEAR = 0.5;
const PROGRESS_LATE = 0.9;

// The node's progress (its slowest rank's pace, the time lost to failures since the job began
// here: docs/api.md, "Progress"); none before the job began.
function progressFacts(progress) {
  if (!progress || typeof progress.since !== "number") return [];
  const pace = typeof progress.steps_per_s === "number" ? progress.steps_per_s.toFixed(2) : "–";
  return [
    ["steps", progress.steps ?? "–"],
    ["steps/s", pace],
    ["time lost", duration(progress.time_lost_s)],
  ];
}

// The progress verdicts in force beside the timeouts: the progress deadline (learned, never
// below the floor) and the deadlines learned for automatic sections.
function progressDeadlines(deadlines) {
  if (!deadlines || typeof deadlines !== "object") return [];
  const span = el("span", "progress-deadline", "progress ");
  span.appendChild(el("b", null, deadlines.enabled ? seconds(deadlines.deadline_s) : "off"));
  span.append("  ");
  const sections = deadlines.automatic_sections_s || {};
  if (!deadlines.enabled || !Object.keys(sections).length) return [span];
  const learned = el("span", null, "automatic sections ");
  learned.appendChild(el("b", null, seconds(sections)));
  return [span, learned];
}

// The node reaches for its rendezvous endpoint (`connecting`) or waits in a round for others
// to join (`waiting`): said in the header, as `ftd status` says it; hidden once the round
// closed, and on the final picture.
function renderWaiting(wait, reach, final) {
  const box = $("waiting");
  const reaching = reach && typeof reach === "object";
  box.hidden = (!reaching && (!wait || typeof wait !== "object")) || Boolean(final);
  if (box.hidden) return;
  if (reaching) {
    const said = typeof reach.last_error === "string" ?
      `${reach.last_error} (${reach.tries} tries)` : "no answer yet";
    box.textContent = `connecting to ${reach.endpoint}: ${said}; gives up in ` +
      (typeof reach.left_s === "number" ? `${Math.round(reach.left_s)} s` : "–");
    return;
  }
  const joined = Array.isArray(wait.joined) ? wait.joined.map(String) : [];
  const missing = Array.isArray(wait.missing) ? wait.missing.map(String) : [];
  const count = Number.isInteger(wait.joined_count) && wait.joined_count >= joined.length ?
    wait.joined_count : joined.length;
  const named = [...joined, ...(count > joined.length ? ["…"] : [])].join(", ");
  const wanted = wait.nnodes_max === wait.nnodes_min ? `${wait.nnodes_min}` :
    `${wait.nnodes_min} to ${wait.nnodes_max}`;
  const left = typeof wait.left_s === "number" ? `${Math.round(wait.left_s)} s` : "–";
  box.textContent = `waiting for nodes in round ${wait.round} at ${wait.endpoint}: ` +
    `${count} of ${wanted} joined (${named || "none"}); ` +
    `missing: ${missing.join(", ") || "none"}; gives up in ${left}`;
}

// A straggler rank's cell in the ranks table: by how much, in what, since when (the status's
// `progress.straggler`, as `ftd status` says it); "–" for a rank that is not one.
const STRAGGLER_SIGNALS = { forward: "forward", host: "host time" };
function stragglerCell(progress) {
  const straggler = progress && progress.straggler;
  if (!straggler || typeof straggler.ratio !== "number") return el("td", "straggler", "–");
  const what = STRAGGLER_SIGNALS[straggler.signal] ?? "–";
  const since = typeof straggler.since === "number" ? clock(straggler.since) : "–";
  const cell = el("td", "straggler slow", `${straggler.ratio.toFixed(1)}x ${what} since ${since}`);
  cell.title = straggler.signal === "host" ?
    "its data loading and host work between steps take longer than the job's other ranks'" :
    "its forward pass takes longer than the job's other ranks'";
  return cell;
}
