// pagedkv router dashboard: polls /dashboard/fleet once a second. Vanilla JS, no CDN.
// Every value is put in the page as text (dom.js): nothing from the fleet JSON is parsed as HTML.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const host = (url) => String(url).replace(/^https?:\/\//, "");
  const num = (v, digits) => (Number.isFinite(Number(v)) ? Number(v).toFixed(digits) : "-");
  function backendRow(b) {
    const blocks = b.indexed_blocks || {};
    return el("tr", { "data-backend": b.name },
      el("td", {}, b.role ? `[${b.role}] ` : null, b.name,
        b.kv_cache_dtype ? ` (${b.kv_cache_dtype})` : null,
        b.kv_problem ? el("div", { class: "problem" }, `no prefix credit: ${b.kv_problem}`) : null),
      el("td", {}, b.up ? "yes" : el("b", {}, "down")), el("td", {}, b.in_flight),
      el("td", {}, num(b.queued_blocks, 1)), el("td", {}, b.running), el("td", {}, b.waiting),
      el("td", {}, barOf(b.kv_usage, `${num(100 * b.kv_usage, 1)}%`)),
      el("td", {}, `${blocks.GPU}/${blocks.CPU}/${blocks.DISK}`));
  }
  function decisionRow(d) {
    const candidates = (d.candidates || []).map((c, i) => [i ? el("br") : null,
      el("span", { class: c.name === d.chosen ? "shared" : "" },
        `${host(c.name)}: ${c.device_blocks}+${c.tier_blocks} hit, ${c.in_flight} in flight` +
        (c.score === null || c.score === undefined ? "" : `, score ${num(c.score, 1)}`))]);
    return el("tr", {}, el("td", {}, new Date(d.time * 1000).toLocaleTimeString()),
      el("td", {}, d.prefix || "-"), el("td", {}, d.prompt_blocks), el("td", {}, d.chosen),
      el("td", {}, candidates));
  }
  const placeRows = (m) => Object.entries(m || {}).slice(-40).map(([k, where]) => el("tr", {},
    el("td", {}, k), el("td", {}, Object.entries(where).map(([b, n]) => `${host(b)} ×${n}`).join(", "))));
  function render(s) {
    $("policy").textContent = s.policy; $("total").textContent = `${s.decisions_total} routed`;
    $("backends").replaceChildren(tableOf(["backend", "up", "in flight", "queued blocks", "running",
      "waiting", "KV usage", "indexed blocks (GPU/CPU/DISK)"], s.backends.map(backendRow),
    "no backend", { id: "backend-table" }));
    $("decisions").replaceChildren(tableOf(["time", "prefix", "blocks", "chosen",
      "candidates (hit blocks, in flight, score)"], s.decisions.slice().reverse().slice(0, 40).map(decisionRow),
    "no request routed yet", { id: "decision-table" }));
    $("prefixes").replaceChildren(tableOf([], placeRows(s.prefixes), "no prefix routed yet"));
    $("sessions").replaceChildren(tableOf([], placeRows(s.sessions), "no session routed yet"));
  }
  // With --api-key: ask for the key once, trade it for a session cookie (server/dashboard/access.py),
  // keep the key in memory only to renew the session.
  let apiKey = null;
  async function openSession(key) {
    const r = await fetch("/dashboard/session", { method: "POST", headers: { Authorization: `Bearer ${key}` } });
    return r.ok;
  }
  async function poll() {
    try {
      const r = await fetch("/dashboard/fleet");
      if (r.status === 401) {
        if (apiKey && await openSession(apiKey)) { setTimeout(poll, 0); return; }  // expired: renew
        $("conn").textContent = "locked";
        const key = window.prompt("This router has an API key. API key:");
        if (!key) return;  // cancelled: stay locked (reload the page to try again)
        if (await openSession(key)) apiKey = key;
      } else { render(await r.json()); $("conn").textContent = "connected"; }
    }
    catch (e) { $("conn").textContent = "unreachable"; }
    setTimeout(poll, 1000);
  }
  poll();
})();
