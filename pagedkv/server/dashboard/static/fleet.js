// pagedkv router dashboard: polls /dashboard/fleet once a second. Vanilla JS, no CDN.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const bar = (f) => `<div class="tier"><div class="bar"><div style="width:${(100 * Math.min(Math.max(f, 0), 1)).toFixed(1)}%"></div></div><span>${(100 * f).toFixed(1)}%</span></div>`;
  function render(s) {
    $("policy").textContent = s.policy; $("total").textContent = `${s.decisions_total} routed`;
    $("backends").innerHTML = `<table id="backend-table"><tr><th>backend</th><th>up</th><th>in flight</th><th>queued blocks</th><th>running</th><th>waiting</th><th>KV usage</th><th>indexed blocks (GPU/CPU/DISK)</th></tr>` +
      s.backends.map((b) => `<tr data-backend="${esc(b.name)}"><td>${esc(b.name)}${b.kv_cache_dtype ? ` (${esc(b.kv_cache_dtype)})` : ""}</td><td>${b.up ? "yes" : "<b>down</b>"}</td><td>${b.in_flight}</td><td>${b.queued_blocks.toFixed(1)}</td><td>${b.running}</td><td>${b.waiting}</td><td>${bar(b.kv_usage)}</td><td>${b.indexed_blocks.GPU}/${b.indexed_blocks.CPU}/${b.indexed_blocks.DISK}</td></tr>`).join("") + "</table>";
    $("decisions").innerHTML = `<table id="decision-table"><tr><th>time</th><th>prefix</th><th>blocks</th><th>chosen</th><th>candidates (hit blocks, in flight, score)</th></tr>` +
      s.decisions.slice().reverse().slice(0, 40).map((d) => `<tr><td>${new Date(d.time * 1000).toLocaleTimeString()}</td><td>${d.prefix || "-"}</td><td>${d.prompt_blocks}</td><td>${esc(d.chosen)}</td><td>${d.candidates.map((c) => `<span class="${c.name === d.chosen ? "shared" : ""}">${esc(c.name.replace(/^https?:\/\//, ""))}: ${c.device_blocks}+${c.tier_blocks} hit, ${c.in_flight} in flight${c.score === null ? "" : `, score ${c.score.toFixed(1)}`}</span>`).join("<br>")}</td></tr>`).join("") + "</table>";
    const place = (m) => Object.entries(m).slice(-40).map(([k, where]) => `<tr><td>${esc(k)}</td><td>${Object.entries(where).map(([b, n]) => `${esc(b.replace(/^https?:\/\//, ""))} ×${n}`).join(", ")}</td></tr>`).join("");
    $("prefixes").innerHTML = `<table>${place(s.prefixes) || '<tr><td class="hint">no prefix routed yet</td></tr>'}</table>`;
    $("sessions").innerHTML = `<table>${place(s.sessions) || '<tr><td class="hint">no session routed yet</td></tr>'}</table>`;
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
