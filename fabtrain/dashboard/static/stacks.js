// A hang's evidence with its event: each process's top frame (carried by the hang or teardown
// event), and on a click every thread's stack as the node saved it before the teardown
// (/api/stacks/<node>, the files `fab logs --stacks` prints). The events list is redrawn at
// every refresh, so what is open and what was read are kept here. Uses app.js's el, api,
// causeKey, naturalCompare and state; a separate file so the live page's code stays as it is.
"use strict";

// Event keys shown open; event key -> what its node said (read once an event: a later hang's
// teardown writes the files anew).
const stacks = {open: new Set(), saved: new Map()};

// The block under an event that carries `stacks`; null for any other event.
function stackBlock(e) {
  if (!e.stacks || typeof e.stacks !== "object") return null;
  const key = causeKey(e);
  const names = Object.keys(e.stacks).sort(naturalCompare);
  const open = stacks.open.has(key);
  const toggle = el("a", {href: "#", class: "stacks-toggle", onclick: ev => { ev.preventDefault(); toggleStacks(key, e.node); }},
    open ? "hide stacks" : `stacks of ${names.length} process${names.length === 1 ? "" : "es"}`);
  if (!open) return el("div", {class: "stacks"}, toggle);
  const saved = stacks.saved.get(key);
  const rows = names.map(name => {
    const s = e.stacks[name] || {};
    const full = saved && saved.stacks ? saved.stacks[name] : null;
    return el("div", {class: "stack", "data-process": name},
      el("b", {}, name),
      el("span", {class: "frame"}, s.frame ? ` ${s.frame}` : ` no stack: ${s.why || "not said"}`),
      full ? el("pre", {class: "stack-text"}, full.join("\n")) : null);
  });
  const note = !saved ? "reading the saved stacks…"
    : saved.error ? `cannot read the saved stacks: ${saved.error}`
    : Object.keys(saved.stacks || {}).length ? null : "no stack file was saved on this node";
  return el("div", {class: "stacks open"}, toggle, ...rows, note ? el("div", {class: "muted small"}, note) : null);
}

async function toggleStacks(key, node) {
  if (stacks.open.has(key)) stacks.open.delete(key); else stacks.open.add(key);
  if (state.events) renderEvents(state.events);
  if (!stacks.open.has(key) || stacks.saved.has(key)) return;
  try {
    stacks.saved.set(key, await api(`/api/stacks/${encodeURIComponent(node)}`));
  } catch (err) {
    stacks.saved.set(key, {error: err.message});
  }
  if (state.events) renderEvents(state.events);
}
