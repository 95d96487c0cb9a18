// ftd dashboard: plain JavaScript, no dependencies. Reads the REST API of the daemon that
// served this page; acts with the bearer token typed into the page (sessionStorage only).
// Everything from the daemon is shown with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "ftd-token";
const STAGES = ["detect", "stop", "backoff", "rendezvous", "spawn", "init", "restore", "redo"];
const TERMINAL = ["succeeded", "failed", "stopped"];
const NEAR_DEADLINE = 0.7;
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
  reachable: true,
  reachableAt: 0,
  sincePoll: [],
  final: null,
  causeFor: "",
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

// The token lives in this tab's sessionStorage (this origin only) and travels only in the
// Authorization header of requests to this origin, never in a URL.
function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
  showTokenState();
}

function showTokenState() {
  const has = Boolean(token());
  $("token-state").textContent = has ? "token set (this tab only)" : "no token: status and events only";
  $("token-forget").hidden = !has;
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

// The one duration formatter (ftd/cli has its Python twin, same rules): each band is chosen
// after rounding, so a carry moves to the next band ("1.0 s", never "1000 ms"; "1 min 0 s",
// never "60 s" inside minutes; "1 d 0 h", never "1440 min").
// The twin of ftd.text.duration (the CLI's): the same forms, rounding and carries, held equal
// by tests/api/test_dashboard_truth.py over the same values.
const MAX_DAYS = 100000;
function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "–";
  if (seconds < 0) return `-${duration(-seconds)}`;
  if (seconds >= MAX_DAYS * 86400 - 1800) return `>${MAX_DAYS - 1} d`;
  const nearest = (value) => Math.floor(value + 0.5);
  const millis = nearest(seconds * 1000);
  if (millis < 1000) return millis === 0 && seconds > 0 ? "<1 ms" : `${millis} ms`;
  const hundredths = nearest(seconds * 100);
  if (hundredths < 1000) {
    return `${Math.floor(hundredths / 100)}.${String(hundredths % 100).padStart(2, "0")} s`;
  }
  const tenths = nearest(seconds * 10);
  if (tenths < 600) return `${Math.floor(tenths / 10)}.${tenths % 10} s`;
  const wholeSeconds = nearest(seconds);
  if (wholeSeconds < 3600) return `${Math.floor(wholeSeconds / 60)} min ${wholeSeconds % 60} s`;
  const minutes = nearest(seconds / 60);
  if (minutes < 1440) return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
  const hours = nearest(seconds / 3600);
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}
probe.duration = duration;

function seconds(value) {
  if (value === null || value === undefined) return "off";
  if (typeof value === "object") {
    const parts = Object.entries(value).map(([k, v]) => `${k}:${seconds(v)}`);
    return parts.join(",") || "none";
  }
  return String(value);
}

// A timeout's words from its name, so a new timeout needs no label here:
// rank_out_of_section_timeout -> "out of section", rank_section_timeouts -> "sections".
function timeoutLabel(name) {
  return String(name).replace(/_timeout(s?)$/, "$1").replace(/(^|_)rank_/, "$1").replaceAll("_", " ");
}

// A timeout that maps names to seconds (rank_section_timeouts) rather than one value.
function isTimeoutMap(value) {
  return value !== null && typeof value === "object";
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
