// fabtrain dashboard: polls the JSON API and redraws in place (no reload).
// Everything from the nodes is put in the page with textContent, never innerHTML.
"use strict";

// The token: from the URL that fab dashboard printed (/?token=...) on the first load, then from
// sessionStorage, and out of the address bar and history at once. Never a cookie: cookies ignore
// ports, so every other web app on 127.0.0.1 would get it; sessionStorage is per origin (port
// included) and per tab. It goes to the server only as a header on our own fetches.
const TOKEN_KEY = "fabtrain-dashboard-token";
const TOKEN = (() => {
  const params = new URLSearchParams(location.search);
  const given = params.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? "?" + rest : "") + location.hash);
  }
  return sessionStorage.getItem(TOKEN_KEY);
})();
const AUTH = {"Authorization": "Bearer " + TOKEN};
const REFRESH_MS = Math.max(250, parseInt(document.querySelector('meta[name="fabtrain-refresh-ms"]').content, 10) || 1000);

const state = {
  cursor: null,          // /api/metrics cursor: the next poll asks only for what is new
  trainers: {},          // name -> metric -> {x: [], y: [], last}
  nodes: {},             // node -> metric -> {x: [], y: [], last}
  chartsDirty: true,
  log: null,             // {node, process, offset}
  logPicked: false,      // someone chose the log to show (else the first trainer's is followed)
  lastOk: null,
  job: null,
  inFlight: false,
  timer: null,
};

// -- small helpers ---------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "title") e.title = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  s = Math.max(0, Math.round(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m ${String(sec).padStart(2, "0")}s`;
  if (m) return `${m}m ${String(sec).padStart(2, "0")}s`;
  return `${sec}s`;
}

function ago(ts, now) {
  if (!ts) return "–";
  return duration(now - ts) + " ago";
}

function clock(ts) {
  return new Date(ts * 1000).toLocaleTimeString([], {hour12: false});
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "–";
  if (Number.isInteger(v)) return v.toLocaleString("en-US");
  return Number(v).toPrecision(digits || 4);
}

function bar(percent, text) {
  if (percent === null || percent === undefined) return el("span", {class: "muted"}, "–");
  const cls = percent >= 90 ? "full" : percent >= 70 ? "hot" : "";
  const fill = el("i", {class: cls});
  fill.style.width = Math.min(100, Math.max(0, percent)) + "%";
  return el("span", {}, el("span", {class: "bar"}, fill), text || `${percent.toFixed(0)}%`);
}

async function api(path) {
  const r = await fetch(path, {headers: AUTH, cache: "no-store"});
  const body = await r.json().catch(() => ({error: `HTTP ${r.status}`}));
  if (r.status === 401 || r.status === 403) forgetToken(body.error || `HTTP ${r.status}`);
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

function banner(id, text, cls) {
  const b = document.getElementById(id);
  if (!text) { b.hidden = true; return; }
  b.hidden = false;
  b.className = "banner " + (cls || "");
  b.textContent = text;
}

// -- cluster table -------------------------------------------------------------------------------

function stateClass(p) {
  if (p.state === "exited") return p.exit_code === 0 ? "s-exited-ok" : "s-exited";
  return "s-" + String(p.state || "unknown").replace(/\s+/g, "-");
}

// Who holds each busy GPU of a node (node ops' inventory): a fabtrain job, or a user and pid outside it.
function gpuHolders(g) {
  if (!g || !g.total) return [];
  return [el("div", {class: "small gpu-free"}, `${g.free}/${g.total} GPUs free` + (g.source === "stand-in" ? " (stand-in)" : "")),
    ...(g.busy || []).map(b => el("div", {class: "small gpu-holder", "data-gpu": b.index}, `GPU ${b.index}: ${b.by}`))];
}

function renderCluster(c) {
  state.cluster = c;
  const tbody = document.querySelector("#nodes tbody");
  const rows = [];
  let up = 0;
  const options = [];
  for (const n of c.nodes) {
    if (n.up) up++;
    const h = n.health;
    let status;
    if (n.up === true) {
      status = el("span", {}, el("span", {class: "dot up"}), "up", el("span", {class: "muted small"}, " since " + clock(n.since)));
    } else if (n.up === false) {
      status = el("span", {}, el("span", {class: "dot down"}), n.down || "unreachable",
        el("span", {class: "muted small"}, " since " + clock(n.since)), el("div", {class: "err"}, n.error || ""));
    } else {
      status = el("span", {}, el("span", {class: "dot unknown"}), "connecting…");
    }
    if (h && h.stale) status.append(el("span", {class: "tag stale", title: "the node agent's health.json is old"}, `agent ${duration(h.age)} old`));
    const host = (h && h.host) || {};
    const gpus = (h && h.gpus) || [];
    const gpuCell = gpus.length
      ? el("div", {}, gpus.map(g => el("div", {class: "small"},
          `#${g.index} ${fmt(g.util, 3)}% · ${bytes(g.mem_used)}/${bytes(g.mem_total)} · ${g.temp ?? "–"}°C`)))
      : el("span", {class: "muted"}, h ? "none" : "–");
    gpuCell.append(...gpuHolders(n.gpu_holders));
    const procs = n.processes.map(p => {
      options.push([n.name, p.name]);
      return el("span", {
        class: "chip " + stateClass(p),
        title: `pid ${p.pid ?? "–"}` + (p.launcher_pid != null && p.launcher_pid !== p.pid ? ` (launcher ${p.launcher_pid})` : "")
          + ` · ${p.label}` + (p.cpu_percent != null ? ` · cpu ${p.cpu_percent}%` : "")
          + (p.step_rate != null ? ` · ${p.step_rate} steps/s` : "") + (p.last_line ? `\n${p.last_line}` : ""),
        "data-node": n.name, "data-process": p.name, "data-state": p.state,
        onclick: () => selectLog(n.name, p.name),
      }, `${p.name}: ${p.label}`);
    });
    const net = host.net_rx_bps !== undefined ? `${bytes(host.net_rx_bps)}/s / ${bytes(host.net_tx_bps)}/s` : "–";
    const disk = host.disk_percent !== undefined ? bar(host.disk_percent, `${host.disk_percent.toFixed(0)}% · ${bytes(host.disk_free)} free`) : bar(null);
    const mem = host.mem_percent !== undefined ? bar(host.mem_percent, `${host.mem_percent.toFixed(0)}% of ${bytes(host.mem_total)}`) : bar(null);
    rows.push(el("tr", {class: n.up === false ? "down" : "", "data-node": n.name},
      el("td", {}, el("b", {}, n.name), el("div", {class: "muted small"}, `${n.host} · ${n.roles.join(", ")}`)),
      el("td", {}, status),
      el("td", {}, bar(host.cpu_percent)),
      el("td", {}, mem),
      el("td", {}, disk),
      el("td", {class: "small"}, net),
      el("td", {}, gpuCell),
      el("td", {}, procs.length ? procs : el("span", {class: "muted"}, n.job_id ? "no processes" : "no job"))));
  }
  tbody.replaceChildren(...rows);
  document.getElementById("cluster-summary").textContent = `${up}/${c.nodes.length} nodes up`;
  document.getElementById("cluster-name").textContent = "· " + c.cluster;
  document.title = "fabtrain · " + c.cluster;
  updateLogOptions(options);
}

// -- job and trainers ---------------------------------------------------------------------------

function renderJob(j) {
  state.job = j;
  document.getElementById("job-id").textContent = j.job_id || "–";
  const badge = document.getElementById("job-state");
  badge.textContent = j.state;
  badge.className = "badge state-" + (["running", "starting", "finished", "failed", "killed", "restarting"].includes(j.state) ? j.state : "none");
  document.getElementById("job-elapsed").textContent = duration(j.elapsed);
  const p = j.processes;
  document.getElementById("job-counts").textContent =
    `${p.running}/${p.total} processes running` + (p.failed ? ` · ${p.failed} failed` : "") + (p.killed ? ` · ${p.killed} killed` : "") +
    (j.restarts_left != null || j.generation ? ` · generation ${j.generation || 0}` +
      (j.restarts_left != null ? `, ${j.restarts_left} restart${j.restarts_left === 1 ? "" : "s"} left` : "") : "");
  const scheduler = document.getElementById("job-scheduler");  // Slurm's own state (PENDING and why, RUNNING, ...)
  scheduler.hidden = !j.scheduler;
  scheduler.textContent = j.scheduler || "";
  const marks = JSON.stringify(j.restarts || []);
  if (marks !== state.restartMarks) { state.restartMarks = marks; state.chartsDirty = true; }
  killControl(j.kill);
  renderVerdict(j);
  const rows = j.trainers.map(t => el("tr", {class: t.stale ? "stale" : "", "data-trainer": t.name},
    el("td", {}, el("b", {}, t.name), t.stale ? el("span", {class: "tag stale", title: `no metrics record for over ${j.stale_after}s`}, "stale") : null,
      t.straggler ? el("span", {class: "tag straggler", title: "below the straggler share of the median rank's step rate (watchdog.straggler)"},
        t.straggler.mark) : null,  // fab status's words
      // no record yet: what it printed last is its sign of life
      !t.records && t.last_line ? el("div", {class: "last-line", title: "its last log line (no metrics record yet)"}, t.last_line) : null),
    el("td", {}, t.node || "–"),
    el("td", {}, t.label),
    el("td", {class: "num", title: t.framework ? `reported by the launcher's hook (${t.framework})` : ""},
      fmt(t.step) + (t.total_steps ? ` / ${fmt(t.total_steps)}` : "")),
    el("td", {class: "num"}, fmt(t.epoch)),
    el("td", {class: "num"}, fmt(t.loss, 5)),
    el("td", {class: "num"}, fmt(t.samples_per_s, 5)),
    el("td", {}, t.last_progress ? ago(t.last_progress, j.now) : "–"),
    checkpointCell(t.checkpoint, j.now)));
  document.querySelector("#trainers tbody").replaceChildren(...rows);
  // what the running generation resumed from, and the steps the restart lost (fab status's words)
  const resumed = document.getElementById("resumed");
  resumed.hidden = !(j.resumed || []).length;
  resumed.textContent = (j.resumed || []).join(" · ");
  const stale = j.stale.length ? ` · ${j.stale.length} stale` : "";
  document.getElementById("trainer-summary").textContent = `${j.trainers.length} trainers${stale}`;
  const problems = [];
  if (j.stale.length) problems.push(`no progress for over ${j.stale_after}s: ${j.stale.join(", ")}`);
  banner("banner", problems.join(" · "), "");
}

// A trainer's last checkpoint: its step, age, size and time to save, then the steps since it (at risk).
function checkpointCell(c, now) {
  if (!c) return el("td", {class: "muted", title: "no checkpoint save seen"}, "–");
  const said = [c.at ? ago(c.at, now) : null, c.bytes !== null ? bytes(c.bytes) : null,
    c.seconds !== null ? `saved in ${c.seconds < 0.1 ? Math.round(c.seconds * 1000) + " ms" :
      c.seconds < 10 ? c.seconds.toFixed(1) + " s" : duration(c.seconds)}` : null].filter(Boolean);
  return el("td", {title: c.text || ""}, `step ${fmt(c.step)}` + (said.length ? ` (${said.join(", ")})` : ""),
    c.steps_since !== null ? el("div", {class: "muted"}, `at risk: ${fmt(c.steps_since)} steps, ${duration(c.seconds_since)}`) : null);
}

// The Kill button does something only while something of the job can still run; its tooltip says why
// (not). The title sits on the wrapper too: a disabled button gets no mouse events, so no tooltip.
function killControl(kill) {
  const button = document.getElementById("kill");
  if (state.killing) return;
  button.disabled = !kill.enabled;
  button.title = kill.why;
  button.parentElement.title = kill.enabled ? "" : kill.why;
}

const VERDICT_CLASS = {failed: "bad", restarting: "warn", killed: "warn", finished: "ok", running: "info", starting: "info"};

// What happened, first: the verdict's sentence (the words fab status prints), and links to the event
// and the log line of the process where a failure began.
function renderVerdict(j) {
  const box = document.getElementById("verdict");
  const c = j.cause;
  const key = JSON.stringify([j.sentence, c]);
  if (key === box.dataset.key) return;
  box.dataset.key = key;
  const links = [];
  if (c && c.event) {
    const e = c.event;
    links.push(el("a", {href: "#events", class: "cause-event", title: e.reason || "",
      onclick: ev => { ev.preventDefault(); showCauseEvent(); }},
      `event: ${e.ts ? clock(e.ts) + " " : ""}${e.kind}${c.process ? " " + c.process : ""} on ${c.node}`));
  }
  if (c && c.process) {
    links.push(el("a", {href: "#log", class: "cause-log", title: "follow this process's log",
      onclick: ev => { ev.preventDefault(); selectLog(c.node, c.process); document.getElementById("log").scrollIntoView({block: "center"}); }},
      `log of ${c.process} on ${c.node}` + (c.log_line ? `: ${c.log_line}` : "")));
  }
  box.hidden = false;
  box.dataset.state = j.state;
  box.className = "verdict " + (VERDICT_CLASS[j.state] || "");
  box.replaceChildren(el("span", {class: "sentence"}, j.sentence),
    ...(links.length ? [el("span", {class: "cause"}, ...links.flatMap((a, i) => i ? [" · ", a] : [a]))] : []));
  markCauseEvent();
}

function causeKey(e) {
  return e ? `${e.node}|${e.ts}|${e.kind}` : null;
}

// The events list is redrawn at every refresh: the mark (and the lit-up moment after a click on the
// banner's link) is put back on the new items each time.
const FLASH_MS = 2000;

function markCauseEvent() {
  const c = state.job && state.job.cause;
  const key = causeKey(c && c.event);
  const lit = Date.now() - (state.causeShown || 0) < FLASH_MS;
  for (const li of document.querySelectorAll("#events li[data-key]")) {
    li.classList.toggle("cause", li.dataset.key === key);
    li.classList.toggle("flash", lit && li.dataset.key === key);
  }
}

function showCauseEvent() {
  state.causeShown = Date.now();
  markCauseEvent();
  const li = document.querySelector("#events li.cause");
  if (li) li.scrollIntoView({block: "nearest"});
  setTimeout(markCauseEvent, FLASH_MS);
}

// -- charts ---------------------------------------------------------------------------------------

function merge(store, incoming) {
  for (const [owner, metrics] of Object.entries(incoming)) {
    const o = store[owner] || (store[owner] = {});
    for (const [metric, s] of Object.entries(metrics)) {
      const cur = o[metric];
      if (s.reset || !cur) o[metric] = {x: s.x.slice(), y: s.y.slice(), last: s.last};
      else { cur.x.push(...s.x); cur.y.push(...s.y); cur.last = s.last; }
    }
  }
}

function traces(store, metric, isTime) {
  const out = [];
  for (const owner of Object.keys(store).sort(naturalCompare)) {
    const s = store[owner][metric];
    if (!s) continue;
    let x = s.x, y = s.y;
    if (s.last) { x = x.concat([s.last[0]]); y = y.concat([s.last[1]]); }
    const since = isTime && state.job && state.job.started_at;
    if (since) {  // a node's readings from before the job started are not the job's
      const keep = x.map(t => t >= since);
      x = x.filter((_, i) => keep[i]); y = y.filter((_, i) => keep[i]);
    }
    if (isTime) x = x.map(t => new Date(t * 1000));
    out.push({x, y, name: owner, type: "scatter", mode: x.length > 1 ? "lines" : "markers", line: {width: 1.6}});
  }
  return out;
}

function naturalCompare(a, b) {
  return a.localeCompare(b, undefined, {numeric: true});
}

const AXIS = {gridcolor: "#26313d", zerolinecolor: "#26313d", linecolor: "#26313d"};

let revision = 0;

function layout(title, xtitle, ytitle, empty, percent) {
  const l = {
    datarevision: ++revision,  // the arrays grow in place: tell Plotly.react they changed
    title: {text: title, font: {size: 13}, x: 0.02},
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)",
    font: {color: "#d7dee6", size: 11},
    margin: {l: 50, r: 10, t: 30, b: 36},
    xaxis: Object.assign({title: {text: xtitle}}, AXIS),
    yaxis: Object.assign({title: {text: ytitle}}, AXIS),
    legend: {orientation: "h", y: -0.22, font: {size: 10}},
    showlegend: true,
    uirevision: title,  // keep the user's zoom across refreshes
  };
  if (percent) l.yaxis.range = [0, 102];
  if (empty) l.annotations = [{text: empty, showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: {color: "#8593a3"}}];
  return l;
}

// Each restart (on_failure restart) as a dashed line at the first step recorded after it, on the step charts.
function withRestarts(l) {
  const marks = ((state.job || {}).restarts || []).filter(r => r.step !== null && r.step !== undefined);
  l.shapes = marks.map(r => ({type: "line", xref: "x", yref: "paper", x0: r.step, x1: r.step, y0: 0, y1: 1,
                              line: {color: "#e0a030", width: 1, dash: "dash"}}));
  l.annotations = (l.annotations || []).concat(marks.map(r => ({x: r.step, xref: "x", y: 1, yref: "paper",
    text: `restart ${r.generation}`, showarrow: false, yanchor: "bottom", font: {size: 10, color: "#e0a030"},
    hovertext: r.reason || ""})));
  return l;
}

// Time axes in units that suit the span shown: seconds for a few minutes, minutes for hours, days for
// a week; never below a second. A short series (one point, a job a minute old) is shown over at least
// MIN_SPAN_MS, so one dot does not get ticks a ten-thousandth of a second apart.
const MIN_SPAN_MS = 120000;
const TIME_TICKS = [  // by the distance between two ticks, in ms (the bounds are inclusive)
  {dtickrange: [null, 59999], value: "%H:%M:%S"},
  {dtickrange: [60000, 86399999], value: "%H:%M"},
  {dtickrange: [86400000, null], value: "%b %d"},
];
const MIN_STEPS = 10;

function span(data, value) {
  let lo = Infinity, hi = -Infinity;
  for (const t of data) for (const x of t.x) { const v = value(x); if (v < lo) lo = v; if (v > hi) hi = v; }
  return [lo, hi];
}

function timeAxis(data) {
  const axis = {type: "date", tickformatstops: TIME_TICKS, hoverformat: "%b %d %H:%M:%S"};
  const [lo, hi] = span(data, d => d.getTime());
  if (hi - lo < MIN_SPAN_MS) axis.range = [new Date(hi - MIN_SPAN_MS * 0.95), new Date(hi + MIN_SPAN_MS * 0.05)];
  return axis;
}

function stepAxis(data) {
  const [lo, hi] = span(data, Number);
  // Steps are whole numbers: a run of a few steps is shown over MIN_STEPS, never as -1..1 in halves.
  return hi - lo < MIN_STEPS ? {range: [lo - 0.5, lo + MIN_STEPS + 0.5], tickformat: "d"} : {tickformat: "~s"};
}

// Why a chart has nothing to show, in words (it then collapses to this one line).
function emptyReason(metric, field) {
  const job = state.job || {}, nodes = (state.cluster || {}).nodes || [];
  if (metric === "cpu" || metric === "gpu") {
    if (!nodes.some(n => n.health)) return "no node agent has reported yet (the watchdog writes each node's health.json)";
    if (metric === "gpu" && !nodes.some(n => n.health && n.health.gpus.length)) return "no GPUs on these nodes";
    return `no ${field} figure from the node agents yet`;
  }
  if (!job.job_id) return "no job on any node";
  const recorded = Object.keys(state.trainers).length || (job.trainers || []).some(t => t.records);
  if (recorded) return `this job reports no ${field} (its metrics records have no "${metric}" field)`;
  if (job.state === "starting") return "waiting for the trainers' first metrics record";
  return "no trainer has written a metrics record ($FABTRAIN_METRICS)";
}

const CHARTS = [
  // id, series, metric, title, x title, y title, what it is called when empty, percent
  ["chart-loss", "trainers", "loss", "loss", "step", "loss", "loss", false],
  ["chart-sps", "trainers", "samples_per_s", "samples/s of each trainer, every record", "step", "samples/s", "samples/s", false],
  ["chart-cpu", "nodes", "cpu", "node CPU %", "", "%", "CPU", true],
  ["chart-gpu", "nodes", "gpu", "node GPU utilisation % (mean of the node's GPUs)", "", "%", "GPU", true],
];

function emptyLine(div, title, why) {
  const chart = div.parentElement;
  let line = chart.querySelector(".empty-line");
  if (!line) { line = el("p", {class: "empty-line"}); chart.append(line); }
  if (line.dataset.why !== why) { line.replaceChildren(el("b", {}, title), why); line.dataset.why = why; }
  if (!chart.classList.contains("empty")) { chart.classList.add("empty"); if (window.Plotly) Plotly.purge(div); }
}

function drawCharts() {
  if (!window.Plotly) return;
  const dirty = state.chartsDirty;
  state.chartsDirty = false;
  const conf = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"]};
  for (const [id, group, metric, title, xt, yt, field, percent] of CHARTS) {
    const div = document.getElementById(id);
    const isTime = group === "nodes";
    const data = traces(state[group], metric, isTime);
    if (!data.length) { emptyLine(div, title, emptyReason(metric, field)); continue; }
    const shown = !div.parentElement.classList.contains("empty");
    if (shown && !dirty) continue;
    div.parentElement.classList.remove("empty");
    const l = layout(title, xt, yt, null, percent);
    Object.assign(l.xaxis, isTime ? timeAxis(data) : stepAxis(data));
    Plotly.react(div, data, isTime ? l : withRestarts(l), conf);
  }
}

// -- logs -----------------------------------------------------------------------------------------

function updateLogOptions(options) {
  const select = document.getElementById("log-select");
  const want = options.map(([n, p]) => `${n}/${p}`);
  const have = Array.from(select.options).slice(1).map(o => o.value);
  if (want.join("|") === have.join("|")) return;
  const current = select.value;
  select.replaceChildren(el("option", {value: ""}, "choose a process…"),
    ...want.map(v => el("option", {value: v}, v.replace("/", " · "))));
  select.value = want.includes(current) ? current : "";
  // Until someone picks (or clears) a process, the panel follows the first trainer's log: a program that
  // writes no metrics shows its progress there, as the head of `fab logs` would.
  if (!state.log && !state.logPicked) {
    const first = options.find(([, p]) => p.startsWith("trainer")) || options[0];
    if (first) selectLog(first[0], first[1], false);
  }
}

function selectLog(node, process, picked = true) {
  state.logPicked = state.logPicked || picked;
  state.log = {node, process, offset: null};
  document.getElementById("log-select").value = `${node}/${process}`;
  document.getElementById("log").textContent = "loading…";
  pollLog();
}

async function pollLog() {
  const sel = state.log;
  if (!sel) return;
  const q = sel.offset === null ? "" : `?offset=${sel.offset}`;
  const r = await api(`/api/logs/${encodeURIComponent(sel.node)}/${encodeURIComponent(sel.process)}${q}`);
  if (state.log !== sel) return;  // the user picked another one meanwhile
  sel.offset = r.offset;
  if (r.unchanged) return;
  const pre = document.getElementById("log");
  const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  pre.textContent = r.lines.length ? r.lines.join("\n") : (r.offset === null ? "(waiting for the next poll of the node…)" : "(empty log)");
  if (atBottom || document.getElementById("log-follow").checked) pre.scrollTop = pre.scrollHeight;
}

// -- events ---------------------------------------------------------------------------------------

function renderEvents(ev) {
  state.events = ev;
  const items = ev.events.map(e => {
    const who = [e.node, e.role !== undefined ? `${e.role}${e.rank !== undefined ? "-" + e.rank : ""}` : null].filter(Boolean).join(" ");
    return el("li", {"data-kind": e.kind, "data-key": causeKey(e)},
      el("span", {class: "when"}, e.ts ? clock(e.ts) : "–"),
      el("span", {class: "kind " + String(e.kind || "")}, e.kind || "event"),
      el("span", {}, who),
      e.signal || e.pid ? el("span", {class: "muted"}, ` (${[e.signal, e.pid ? "pid " + e.pid : null].filter(Boolean).join(", ")})`) : null,
      e.reason ? el("span", {class: "reason"}, e.reason) : null,
      stackBlock(e));  // a hang's stacks (stacks.js)
  });
  const list = document.getElementById("events");
  list.replaceChildren(...(items.length ? items : [el("li", {class: "muted"}, "no events yet")]));
  markCauseEvent();
}

// -- the loop -------------------------------------------------------------------------------------

async function refresh() {
  if (state.inFlight) return;
  state.inFlight = true;
  try {
    const since = state.cursor ? `?since=${encodeURIComponent(state.cursor)}` : "";
    const [cluster, job, metrics, events] = await Promise.all([
      api("/api/cluster"), api("/api/job"), api("/api/metrics" + since), api("/api/events?limit=100"),
    ]);
    renderCluster(cluster);
    renderJob(job);
    if (metrics.full) { state.trainers = {}; state.nodes = {}; }
    merge(state.trainers, metrics.trainers);
    merge(state.nodes, metrics.nodes);
    if (metrics.full || Object.keys(metrics.trainers).length || Object.keys(metrics.nodes).length) state.chartsDirty = true;
    state.cursor = metrics.cursor;
    drawCharts();
    renderEvents(events);
    if (state.log && document.getElementById("log-follow").checked) await pollLog().catch(e => {
      document.getElementById("log").textContent = "cannot read the log: " + e.message;
    });
    state.lastOk = Date.now();
    document.getElementById("updated").textContent = "live · updated " + new Date().toLocaleTimeString([], {hour12: false});
  } catch (e) {
    const since = state.lastOk ? ` (last update ${Math.round((Date.now() - state.lastOk) / 1000)}s ago)` : "";
    document.getElementById("updated").textContent = "dashboard unreachable" + since;
    banner("banner", "cannot reach the dashboard: " + e.message + since, "bad");
  } finally {
    state.inFlight = false;
  }
}

async function kill() {
  const job = state.job && state.job.job_id;
  if (!confirm(`Kill job ${job || ""} on every node? Every fabtrain process gets SIGTERM, then SIGKILL.`)) return;
  const button = document.getElementById("kill");
  button.disabled = true;
  state.killing = true;
  banner("kill-result", "killing the job…", "");
  try {
    const r = await fetch("/api/kill", {method: "POST", headers: AUTH});
    const body = await r.json().catch(() => ({error: `HTTP ${r.status}`}));
    if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
    // kill-all also lists the children it killed with their process group: count processes once
    const killed = body.nodes.reduce((n, x) => n + (x.killed ? x.killed.filter(k => !k.child).length : 0), 0);
    const failed = body.nodes.filter(x => !x.ok).map(x => `${x.node}: ${x.error}`);
    const left = body.nodes.filter(x => x.left && x.left.length).map(x => `${x.node}: pids ${x.left.join(", ")} still alive`);
    // where the place stopped the job (Slurm's scancel), its own word instead of the nodes'
    const said = body.nodes.length || !(body.place || []).length ?
      `kill: ${killed} processes stopped on ${body.nodes.length} nodes in ${body.seconds}s` :
      `kill: ${body.place.join(" · ")} in ${body.seconds}s`;
    const problems = failed.concat(left, body.ok || !body.problem ? [] : [body.problem]);
    banner("kill-result", said + (problems.length ? " · " + problems.join(" · ") : ""), body.ok ? "ok" : "bad");
  } catch (e) {
    banner("kill-result", "kill refused: " + e.message, "bad");
  } finally {
    state.killing = false;
    if (state.job) killControl(state.job.kill);
    refresh();
  }
}

function forgetToken(reason) {
  // A token the server refuses (a restarted dashboard has a new one) is no use to keep.
  sessionStorage.removeItem(TOKEN_KEY);
  noToken("the dashboard refused the token (" + reason + ")");
}

function noToken(why) {
  clearInterval(state.timer);
  document.getElementById("kill").hidden = true;
  document.getElementById("updated").textContent = "no token";
  banner("banner", why + ": open the URL that fab dashboard printed (http://…/?token=…)", "bad");
}

document.getElementById("kill").addEventListener("click", kill);
document.getElementById("log-select").addEventListener("change", e => {
  const v = e.target.value;
  state.logPicked = true;
  if (!v) { state.log = null; return; }
  const [node, process] = v.split("/");
  selectLog(node, process);
});
window.addEventListener("load", () => { state.chartsDirty = true; drawCharts(); });
if (TOKEN) {
  refresh();
  state.timer = setInterval(refresh, REFRESH_MS);
} else {
  noToken("this page has no token");
}
