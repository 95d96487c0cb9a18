// ftd dashboard, the actions and the start (the scripts share one global scope; core.js is loaded first).
"use strict";

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
  for (const [name, now] of Object.entries(current)) {
    const input = $(`t-${name}`);
    if (!input) continue;
    if (isTimeoutMap(now)) {
      const values = parseSections(input.value);
      if (JSON.stringify(values) !== JSON.stringify(now)) patch[name] = values;
    } else {
      const value = parseSeconds(name, input.value);
      if (value !== now) patch[name] = value;
    }
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
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token").value.trim();
    if (value) setToken(value);
    $("token").value = "";
  });
  $("token-forget").addEventListener("click", () => setToken(""));
  showTokenState();
}

function wireFilters() {
  for (const id of ["filter-kind", "filter-node", "filter-text"]) {
    $(id).addEventListener("input", renderEvents);
  }
}

async function start() {
  wireToken();
  wireCauseToken();
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
