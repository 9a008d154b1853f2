// The run history: the jobs list (/api/jobs), one old job (/api/jobs/<id>), and overlays of
// two or more runs' loss and throughput, by step or by wall time (seconds since each run's
// first record). Uses app.js's helpers (el, api, fmt, duration, layout); a separate file so
// the live page's code stays as it is.
"use strict";

const hist = {jobs: [], picked: new Set(), details: new Map(), xWall: false};

function outcomeClass(o) {
  return "state-" + (["running", "starting", "finished", "failed", "killed"].includes(o) ? o : "none");
}

// What differs between the picked runs: env keys (and the command) that are not the same in all.
function differences(jobs) {
  const keys = new Set(jobs.flatMap(j => Object.keys(j.env || {})));
  const diff = [...keys].filter(k => new Set(jobs.map(j => (j.env || {})[k])).size > 1).sort();
  const cmd = j => (j.command || []).join(" ").split(j.job_id).join("<job>");
  const cmdDiffers = new Set(jobs.map(cmd)).size > 1;
  return j => {
    const parts = diff.map(k => `${k}=${(j.env || {})[k] ?? "∅"}`);
    if (cmdDiffers) parts.push(cmd(j));
    return parts.length ? `${j.job_id} (${parts.join(", ")})` : j.job_id;
  };
}

function renderJobs(reply) {
  hist.jobs = reply.jobs || [];
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren(...hist.jobs.map(j => el("tr", {"data-job": j.job_id},
    el("td", {}, el("input", {type: "checkbox", class: "pick", checked: hist.picked.has(j.job_id) || null,
                               onchange: e => { e.target.checked ? hist.picked.add(j.job_id) : hist.picked.delete(j.job_id); compareControl(); }})),
    el("td", {}, el("a", {href: "#", class: "open", onclick: e => { e.preventDefault(); openJob(j.job_id); }}, j.job_id)),
    el("td", {}, j.started ? new Date(j.started * 1000).toLocaleString([], {hour12: false}) : "–"),
    el("td", {}, duration(j.duration)),
    el("td", {}, el("span", {class: "badge " + outcomeClass(j.outcome), title: j.reason || ""}, j.outcome)),
    el("td", {class: "num"}, fmt(j.restarts)),
    el("td", {class: "num"}, fmt(j.loss)),
    el("td", {class: "num"}, fmt(j.samples_per_s)),
  )));
  const down = (reply.unreachable || []).map(u => `${u.node}: ${u.error}${u.cached ? " (shown as last seen)" : ""}`);
  document.getElementById("jobs-note").textContent = down.length ? "unreachable: " + down.join("; ") : "";
  compareControl();
}

// "compare checked" overlays two runs or more: with fewer checked it can do nothing, and says so.
function compareControl() {
  const listed = new Set(hist.jobs.map(j => j.job_id));
  const n = [...hist.picked].filter(id => listed.has(id)).length;
  const button = document.getElementById("jobs-compare");
  button.disabled = n < 2;
  button.title = n < 2 ? `check two jobs or more to compare them (${n} checked)`
                       : "overlay the loss and throughput of the checked jobs";
  button.parentElement.title = n < 2 ? button.title : "";
}

async function loadJobs() {
  try {
    renderJobs(await api("/api/jobs"));
  } catch (e) {
    document.getElementById("jobs-note").textContent = "jobs: " + e.message;
  }
}

async function detail(id) {
  if (!hist.details.has(id)) hist.details.set(id, await api("/api/jobs/" + encodeURIComponent(id)));
  return hist.details.get(id);
}

// One run's trace of a metric: trainers averaged per step (a run is one line when compared).
function runTrace(d, metric, label) {
  const bySteps = new Map();
  let t0 = Infinity;
  for (const [name, cols] of Object.entries(d.series || {})) {
    if (!name.startsWith("trainer")) continue;
    cols.step.forEach((s, i) => {
      const v = cols[metric][i], ts = cols.ts[i];
      if (s === null || v === null) return;
      if (ts !== null) t0 = Math.min(t0, ts);
      const b = bySteps.get(s) || {sum: 0, n: 0, ts: ts};
      b.sum += v; b.n += 1; b.ts = Math.max(b.ts ?? ts, ts ?? b.ts);
      bySteps.set(s, b);
    });
  }
  const steps = [...bySteps.keys()].sort((a, b) => a - b);
  const x = hist.xWall ? steps.map(s => bySteps.get(s).ts - t0) : steps;
  return {x, y: steps.map(s => bySteps.get(s).sum / bySteps.get(s).n), name: label, mode: "lines", type: "scatter"};
}

async function drawOverlay(ids) {
  const ds = await Promise.all(ids.map(detail));
  const label = differences(ds);
  const xt = hist.xWall ? "seconds since the run's first record" : "step";
  const conf = {displaylogo: false, responsive: true};
  for (const [id, metric, title] of [["history-loss", "loss", "loss"], ["history-sps", "samples_per_s", "samples/s (mean of trainers)"]]) {
    const data = ds.map(d => runTrace(d, metric, label(d)));
    if (window.Plotly) Plotly.react(id, data, layout(title, xt, title, data.some(t => t.x.length) ? null : "no " + metric + " recorded"), conf);
  }
  document.getElementById("history-title").textContent = ids.length > 1 ? "compare " + ids.join(", ") : ids[0];
  return ds;
}

async function openJob(id) {
  try {
    const [d] = await drawOverlay([id]);
    document.getElementById("history-detail").hidden = false;
    document.getElementById("history-reason").textContent = `${d.outcome}${d.reason ? ": " + d.reason : ""}`;
    document.getElementById("history-events").replaceChildren(...(d.events || []).slice(-200).reverse().map(e =>
      el("li", {}, el("span", {class: "muted"}, new Date(e.ts * 1000).toLocaleTimeString([], {hour12: false})), " ",
         el("b", {}, e.kind), ` ${e.node || ""} ${e.name || ""}: ${e.reason || ""}`)));
    const lines = Object.entries(d.logs || {}).flatMap(([node, procs]) =>
      Object.entries(procs).flatMap(([p, ls]) => ls.map(l => `[${node} ${p}] ${l}`)));
    document.getElementById("history-log").textContent = lines.join("\n") || "no log lines";
  } catch (e) {
    document.getElementById("jobs-note").textContent = `${id}: ${e.message}`;
  }
}

async function compare() {
  const ids = hist.jobs.map(j => j.job_id).filter(id => hist.picked.has(id));
  if (ids.length < 2) {
    document.getElementById("jobs-note").textContent = "pick two or more jobs to compare";
    return;
  }
  document.getElementById("history-detail").hidden = false;
  document.getElementById("history-reason").textContent = "";
  document.getElementById("history-events").replaceChildren();
  document.getElementById("history-log").textContent = "";
  try {
    await drawOverlay(ids);
  } catch (e) {
    document.getElementById("jobs-note").textContent = "compare: " + e.message;
  }
}

document.getElementById("jobs-refresh").addEventListener("click", () => { hist.details.clear(); loadJobs(); });
document.getElementById("jobs-compare").addEventListener("click", compare);
document.getElementById("history-x").addEventListener("change", e => {
  hist.xWall = e.target.value === "wall";
  const title = document.getElementById("history-title").textContent;
  const ids = title.startsWith("compare ") ? title.slice(8).split(", ") : title ? [title] : [];
  if (ids.length) drawOverlay(ids);
});
if (TOKEN) loadJobs();
