// ftd dashboard, the cluster: one tile per node (the scripts share one global scope; core.js is loaded first).
"use strict";

// -- the cluster ----------------------------------------------------------------------------

async function pollCluster() {
  if (state.final) {
    $("cluster-summary").textContent = "the daemon stopped: the last cluster picture";
    return;
  }
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

// This node's tile says what its snapshot says (the header's and the ranks'), never an older
// or newer cluster summary.
function selfSummary(node, s) {
  const ranks = s.ranks || [];
  const known = state.final || state.reachable; // else: its last known state, greyed
  return {
    ...node,
    node_id: s.node_id,
    state: known ? s.state : `${s.state}?`,
    attempt: s.attempt,
    round: s.round ?? node.round,
    ranks_running: ranks.filter((r) => r.state === "running").length,
    ranks_total: ranks.length,
    last_failure: s.last_failure ? s.last_failure.reason : null,
  };
}

function drawTile(node, excluded, self, fragment) {
  const id = String(node.node_id);
  const isExcluded = excluded.has(id);
  const stateName = String(node.state);
  const round = node.round ?? node.attempt ?? "–";
  const nodeRank = node.group_rank ?? node.node_rank ?? "–";
  // A hot spare: it waits for the round's end to take a lost node's place (`role` in /v1/cluster).
  const standby = node.role === "standby";
  const lines = [id, `${stateName} · round ${round}`,
    nodeRank === "–" ? rankCounts(node) : `rank ${nodeRank} · ${rankCounts(node)}`];
  const signature = `${lines.join("|")}|${isExcluded}|${excluded.get(id)}|${node.last_failure ?? ""}|${id === self}|${standby}`;
  let tile = state.tiles.get(id);
  if (!tile) {
    const box = el("div", "tile");
    box.setAttribute("role", "listitem");
    box.dataset.node = id;
    tile = { box, name: el("div", "name"), badge: el("span", "badge standby", "standby"),
      line1: el("div", "meta"), line2: el("div", "meta"), signature: "" };
    box.append(tile.name, tile.line1, tile.line2);
    box.addEventListener("click", () => { $("exclude-node").value = id; });
    state.tiles.set(id, tile);
    fragment.appendChild(box);
  }
  if (tile.signature !== signature) {
    tile.signature = signature;
    tile.box.className = `tile ${stateClass(stateName)}${isExcluded ? " excluded" : ""}${id === self ? " self" : ""}${standby ? " standby" : ""}`;
    tile.box.dataset.state = stateName;
    tile.name.textContent = lines[0];
    if (standby) tile.name.append(" ", tile.badge);
    tile.line1.textContent = isExcluded ? `excluded · ${stateName}` : lines[1];
    tile.line2.textContent = lines[2];
    const failure = node.last_failure ? `\nlast failure: ${typeof node.last_failure === "string" ? node.last_failure : node.last_failure.reason}` : "";
    const spare = standby ? "\nstandby: waiting to take a lost node's place" : "";
    tile.box.title = `${id}${spare}\n${lines[1]}\n${lines[2]}${isExcluded ? `\nexcluded: ${excluded.get(id)}` : ""}${failure}`;
  }
  return isExcluded ? "excluded" : stateName;
}

function excludedOf(c) {
  const excluded = new Map();
  for (const entry of (c && c.excluded) || []) {
    if (typeof entry === "string") excluded.set(entry, "");
    else if (entry && entry.node_id !== undefined) excluded.set(String(entry.node_id), entry.reason || "");
  }
  return excluded;
}

function renderSelfTile(s) {
  if (state.cluster) {
    renderCluster(); // the counts too; unchanged tiles are not touched
    return;
  }
  const id = String(s.node_id);
  const fragment = document.createDocumentFragment();
  const known = state.cluster && (state.cluster.nodes || []).find((n) => n && String(n.node_id) === id);
  drawTile(selfSummary(known || { node_id: id }, s), excludedOf(state.cluster), id, fragment);
  $("tiles").appendChild(fragment);
}

function renderCluster() {
  const started = performance.now();
  const c = state.cluster;
  const excluded = excludedOf(c);
  const nodes = (c.nodes || []).filter((n) => n && n.node_id !== undefined);
  const known = new Set(nodes.map((n) => String(n.node_id)));
  for (const id of excluded.keys()) {
    if (!known.has(id)) nodes.push({ node_id: id, state: "stopped" });
  }
  const s = snapshot();
  const self = s ? String(s.node_id) : "";
  if (s && !known.has(self)) nodes.push({ node_id: self });
  const counts = new Map();
  const fragment = document.createDocumentFragment();
  const seen = new Set();
  for (const raw of nodes) {
    const id = String(raw.node_id);
    const node = s && id === self ? selfSummary(raw, s) : raw;
    seen.add(id);
    state.nodes.add(id);
    const name = drawTile(node, excluded, self, fragment);
    counts.set(name, (counts.get(name) || 0) + 1);
  }
  $("tiles").appendChild(fragment);
  for (const [id, tile] of state.tiles) {
    if (!seen.has(id)) {
      tile.box.remove();
      state.tiles.delete(id);
    }
  }
  // Every node counted (GET /v1/cluster's `counts`) where the view is a page of a larger job;
  // else the tiles drawn (this node's from its own, fresher, status).
  const paged = Number.isInteger(c.total_nodes) && c.total_nodes > (c.nodes || []).length;
  const every = paged && c.counts && c.counts.state && typeof c.counts.state === "object" ? c.counts.state : null;
  if (every) {
    counts.clear();
    for (const [name, n] of Object.entries(every)) if (Number.isInteger(n) && n > 0) counts.set(name, n);
    const out = Number.isInteger(c.total_excluded) ? c.total_excluded : excluded.size;
    if (out > 0) counts.set("excluded", out);
  }
  const named = c.culprit && typeof c.culprit.reason === "string" ? c.culprit : null;
  $("cluster-culprit").hidden = !named;
  $("cluster-culprit").textContent = named ? `the job's culprit, round ${named.round}: ${named.reason}` : "";
  const countBox = $("cluster-counts");
  countBox.replaceChildren(...[...counts.entries()].sort().map(([name, n]) => {
    const chip = el("span", `count ${name === "excluded" ? "" : stateClass(name)}`, `${n} ${name}`);
    if (name === "excluded") chip.style.background = "var(--excluded)";
    return chip;
  }));
  const round = c.round || {};
  const roles = every && c.counts.role && typeof c.counts.role === "object" ? c.counts.role : null;
  const standbys = roles ? (Number.isInteger(roles.standby) ? roles.standby : 0)
    : nodes.filter((n) => n.role === "standby").length;
  // A page of a larger cluster (GET /v1/cluster's `offset`, `limit`): the totals say how many.
  const total = Number.isInteger(c.total_nodes) ? c.total_nodes : nodes.length;
  const shown = total > nodes.length ? ` (${nodes.length} shown)` : "";
  const members = Number.isInteger(round.size) ? round.size : (round.members || []).length;
  // One read of the nodes' summaries serves the pages asked while it is young (view_age_s).
  const age = typeof c.view_age_s === "number" && c.view_age_s >= 1 ? ` · read ${c.view_age_s.toFixed(1)} s ago` : "";
  $("cluster-summary").textContent =
    `${total} node${total === 1 ? "" : "s"}${shown} · round ${round.round ?? "–"} · ` +
    `${members} members · ${standbys} standby · ${excluded.size} excluded${age}`;
  const list = $("node-ids");
  if (list.childElementCount !== state.nodes.size) {
    list.replaceChildren(...[...state.nodes].sort().map((id) => { const o = el("option"); o.value = id; return o; }));
  }
  refreshNodeFilter();
  probe.clusterRenderMs.push(performance.now() - started);
  if (probe.clusterRenderMs.length > 50) probe.clusterRenderMs.shift();
}
