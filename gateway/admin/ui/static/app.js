// tiergate operations dashboard: polls /admin/ui/api/live and the admin API once a
// second and draws small SVG charts and tables (no libraries, nothing loaded from
// elsewhere). The workers table lists every live worker of the fleet (/admin/v1/queues),
// not only an engine in this process.
"use strict";

const REFRESH_MS = 1000;
const HISTORY = 120; // queue-depth points kept in the page
const COLORS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477"];
const SVG = "http://www.w3.org/2000/svg";
// `edited`: the tier form's fields the operator changed since it was last filled.
const state = { token: null, depthHistory: [], live: null, tiers: [], queues: null, edited: new Set() };
window.tiergate = state; // for operators poking at the console (and the browser test)

function takeToken() {
  const match = location.hash.match(/token=([^&]+)/);
  if (match) {
    sessionStorage.setItem("tiergate-admin-token", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname); // keep the token out of the URL
  }
  return sessionStorage.getItem("tiergate-admin-token");
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { authorization: `Bearer ${state.token}`, "content-type": "application/json" },
  });
  const body = await response.json();
  if (!response.ok) {
    const error = new Error(body.error ? body.error.message : response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}

function el(name, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (parent) parent.appendChild(node);
  return node;
}

function chartBox(name) {
  const box = document.querySelector(`[data-chart="${name}"]`);
  box.replaceChildren();
  return { box, svg: el("svg", { viewBox: "0 0 400 180", preserveAspectRatio: "none" }, box) };
}

function lineChart(name, series, yMax) {
  // series: [{label, points: [[x, y|null], ...]}], x in [0, 1]
  const { box, svg } = chartBox(name);
  let points = 0;
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const drawn = s.points.filter(([, y]) => y !== null && y !== undefined);
    points += drawn.length;
    if (drawn.length) {
      const d = drawn
        .map(([x, y], j) => `${j ? "L" : "M"}${(20 + x * 370).toFixed(1)},${(160 - (y / yMax) * 140).toFixed(1)}`)
        .join(" ");
      el("path", { d, fill: "none", stroke: color, "stroke-width": 2 }, svg);
      for (const [x, y] of drawn) {
        el("circle", { cx: 20 + x * 370, cy: 160 - (y / yMax) * 140, r: 2, fill: color }, svg);
      }
    }
    el("text", { x: 25 + i * 90, y: 175, fill: color }, svg).textContent = s.label;
  });
  el("text", { x: 2, y: 22 }, svg).textContent = String(yMax);
  el("line", { x1: 20, y1: 160, x2: 390, y2: 160, stroke: "#999" }, svg);
  box.dataset.points = String(points);
}

function barChart(name, bars, format = (v) => String(v)) {
  // bars: [{label, value}]
  const { box, svg } = chartBox(name);
  const max = Math.max(1e-9, ...bars.map((b) => b.value));
  const width = 370 / Math.max(bars.length, 1);
  bars.forEach((b, i) => {
    const h = (b.value / max) * 130;
    el("rect", { x: 20 + i * width + 4, y: 150 - h, width: width - 8, height: h, fill: COLORS[i % COLORS.length] }, svg);
    el("text", { x: 20 + i * width + 4, y: 145 - h }, svg).textContent = format(b.value);
    el("text", { x: 20 + i * width + 4, y: 170 }, svg).textContent = b.label.slice(0, 18);
  });
  if (!bars.length) el("text", { x: 150, y: 90 }, svg).textContent = "none";
  box.dataset.points = String(bars.length);
}

function draw(live) {
  const tiers = live.tiers.map((t) => t.name);
  state.depthHistory.push(Object.fromEntries(live.tiers.map((t) => [t.name, t.queue_depth])));
  state.depthHistory = state.depthHistory.slice(-HISTORY);
  const n = Math.max(state.depthHistory.length - 1, 1);
  const depthMax = Math.max(1, ...state.depthHistory.flatMap((h) => Object.values(h)));
  lineChart(
    "queue",
    tiers.map((tier) => ({ label: tier, points: state.depthHistory.map((h, i) => [i / n, h[tier] ?? 0]) })),
    depthMax,
  );
  const series = live.slo_series;
  const m = Math.max(series.length - 1, 1);
  lineChart(
    "slo",
    tiers.map((tier) => ({
      label: tier,
      points: series.map((b, i) => [i / m, b.requests[tier] ? (b.met[tier] || 0) / b.requests[tier] : null]),
    })),
    1,
  );
  barChart("refusals", Object.entries(live.refusals).map(([label, value]) => ({ label, value })));
  barChart("tenants", live.top_tenants.map((t) => ({ label: t.tenant_id, value: t.requests })));
  barChart(
    "workers",
    live.workers.map((w) => ({ label: `${w.id} (${w.num_running} run)`, value: w.kv_cache_usage || 0 })),
    (v) => `${(v * 100).toFixed(0)}%`,
  );
}

const TIER_FIELDS = [
  "rank", "min_share", "ttft_slo_ms", "tpot_slo_ms", "max_queue_ms", "max_queued_jobs", "rpm", "tpm", "max_concurrency",
];

function drawTiers(tiers, live) {
  const byName = Object.fromEntries(live.tiers.map((t) => [t.name, t]));
  const body = document.querySelector("#tiers-table tbody");
  body.replaceChildren(
    ...tiers.map((tier) => {
      const row = document.createElement("tr");
      row.dataset.tier = tier.name;
      const liveTier = byName[tier.name] || {};
      const slo = liveTier.slo_attainment;
      for (const value of [tier.name, ...TIER_FIELDS.map((f) => tier[f]), liveTier.queue_depth ?? 0,
        slo === null || slo === undefined ? "–" : `${(slo * 100).toFixed(1)}%`]) {
        const cell = document.createElement("td");
        cell.textContent = value === null || value === undefined ? "–" : String(value);
        row.appendChild(cell);
      }
      return row;
    }),
  );
  // The form's choices follow the tiers by name (one deleted and another made between
  // two polls leave the count alone). Untouched, the form follows its tier as other
  // admins change it; a poll never wipes what the operator is typing.
  const select = document.querySelector("#tier-form select");
  const chosen = select.value;
  const names = tiers.map((t) => t.name);
  if (names.join("\n") !== Array.from(select.options, (o) => o.value).join("\n")) {
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
  }
  if (!names.includes(chosen) || state.edited.size === 0) fillForm();
}

function fixed(digits) {
  return (v) => v.toFixed(digits);
}

const WORKER_COLUMNS = [
  ["id", String],
  ["heartbeat_age_ms", String],
  ["prefill_tokens_per_s", fixed(0)],
  ["decode_tokens_per_s", fixed(0)],
  ["num_running", String],
  ["num_waiting", String],
  ["kv_cache_usage", (v) => `${(v * 100).toFixed(0)}%`],
  ["backlog_prefill_tokens", String],
  ["backlog_decode_tokens", String],
];

function drawWorkers(workers) {
  const body = document.querySelector("#workers-table tbody");
  body.replaceChildren(
    ...workers.map((worker) => {
      const row = document.createElement("tr");
      row.dataset.worker = worker.id;
      for (const [field, format] of WORKER_COLUMNS) {
        const cell = document.createElement("td");
        const value = worker[field];
        cell.textContent = value === null || value === undefined ? "–" : format(value);
        row.appendChild(cell);
      }
      return row;
    }),
  );
}

function fillForm() {
  const form = document.getElementById("tier-form");
  const tier = state.tiers.find((t) => t.name === form.elements.name.value);
  state.edited.clear();
  if (!tier) return;
  for (const field of TIER_FIELDS) form.elements[field].value = tier[field] ?? "";
}

async function saveTier(event) {
  event.preventDefault();
  const form = event.target;
  const status = document.getElementById("tier-status");
  // Only what the operator changed: a field another admin changed meanwhile is theirs.
  const body = {};
  for (const field of TIER_FIELDS.filter((f) => state.edited.has(f))) {
    const raw = form.elements[field].value.trim();
    body[field] = raw === "" ? (field === "rank" || field === "min_share" ? undefined : null) : Number(raw);
  }
  try {
    const tier = await api(`/admin/v1/tiers/${encodeURIComponent(form.elements.name.value)}`, {
      method: "PATCH",
      body: JSON.stringify(body),
    });
    status.textContent = `saved ${tier.name}`;
    status.className = "";
    state.edited.clear();
    await refresh();
  } catch (error) {
    status.textContent = `not saved: ${error.message}`;
    status.className = "error";
  }
}

async function refresh() {
  try {
    const [live, tiers, queues] = await Promise.all([
      api("/admin/ui/api/live"),
      api("/admin/v1/tiers"),
      api("/admin/v1/queues"),
    ]);
    state.live = live;
    state.tiers = tiers.data;
    state.queues = queues;
    draw(live);
    drawTiers(state.tiers, live);
    drawWorkers(queues.workers.data);
    document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    if (error.status === 401) return showLogin("That token was refused.");
    document.getElementById("updated").textContent = `stale: ${error.message}`;
  }
}

let timer = null;

function showLogin(message = "") {
  clearInterval(timer);
  sessionStorage.removeItem("tiergate-admin-token");
  document.getElementById("board").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("login-error").textContent = message;
}

function start() {
  document.getElementById("login").hidden = true;
  document.getElementById("board").hidden = false;
  refresh();
  timer = setInterval(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("tier-form").addEventListener("submit", saveTier);
  document.querySelector("#tier-form select").addEventListener("change", fillForm);
  document.getElementById("tier-form").addEventListener("input", (event) => {
    if (TIER_FIELDS.includes(event.target.name)) state.edited.add(event.target.name);
  });
  document.getElementById("login").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem("tiergate-admin-token", document.getElementById("token").value);
    state.token = takeToken();
    start();
  });
  state.token = takeToken();
  if (state.token) start();
  else showLogin();
});
