// pagedkv dashboard: the SSE feed -> PageState (state.js) -> canvas grid, tiers, requests,
// block table, prefix forest, rate charts, time scrubber, log replay. No build step, no CDN.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEYFRAME_EVERY = 50, WINDOW_S = 300, RATE_LAG = 10;
  const D = {
    state: null, base: null, entries: [], keyframes: [], view: null, viewIndex: -1,
    live: true, replay: false, selected: null, selectedTable: null, finished: [],
    dirty: true, lastQueues: null, lastFrameMs: 0, source: null,
  };
  window.dashboard = D;

  // ---------------------------------------------------------------- history and scrubbing
  function reset(snapshot) {
    D.state = new PageState(snapshot);
    D.entries = []; D.keyframes = [{ index: -1, state: D.state.clone(), t: snapshot.t || 0 }];
    D.view = D.state; D.viewIndex = -1; D.dirty = true;
    const kv = snapshot.kv_cache_dtype ? ` (${snapshot.kv_cache_dtype} KV cache, ${snapshot.block_bytes} B a block)` : "";
    $("model").textContent = (snapshot.model || "") + kv;
  }
  function push(update) {
    if (update.resync) { reset(update.resync); }
    else D.state.apply(update.ops || [], update.t);
    D.entries.push({ t: update.t, ops: update.ops || [], stats: update.stats, queues: update.queues, finished: update.finished });
    const idx = D.entries.length - 1;
    if (idx % KEYFRAME_EVERY === KEYFRAME_EVERY - 1) D.keyframes.push({ index: idx, state: D.state.clone(), t: update.t });
    trim();
    if (D.live) { D.view = D.state; D.viewIndex = D.entries.length - 1; }
    D.dirty = true;
  }
  function trim() {
    if (D.replay || D.entries.length < 2) return;
    const cutoff = D.entries[D.entries.length - 1].t - WINDOW_S;
    while (D.keyframes.length > 1 && D.entries[D.keyframes[1].index].t < cutoff) {
      const drop = D.keyframes[1].index + 1;
      D.keyframes.shift();
      D.entries.splice(0, drop);
      for (const k of D.keyframes) k.index -= drop;
    }
  }
  function stateAt(index) {
    let kf = D.keyframes[0];
    for (const k of D.keyframes) if (k.index <= index) kf = k;
    const s = kf.state.clone();
    for (let i = kf.index + 1; i <= index; i++) s.apply(D.entries[i].ops, D.entries[i].t);
    return s;
  }
  function scrubTo(index) {
    D.live = index >= D.entries.length - 1 && !D.replay;
    D.viewIndex = index;
    D.view = D.live ? D.state : stateAt(index);
    $("mode").textContent = D.replay ? "replay" : (D.live ? "live" : "history");
    D.dirty = true;
  }
  function snapshotOf(state, t) {
    const parents = {};
    for (const [h, n] of state.forest) parents[h] = n.parent;
    return { t, block_size: state.blockSize, parents, pools: state.pools.map((p) => ({
      refs: Array.from(p.refs), hashes: p.hashes, free_order: Array.from(p.freeOrder.keys()),
      pins: Object.fromEntries(p.pins) })) };
  }
  D.recordedLog = () => ({ snapshot: snapshotOf(D.keyframes[0].state, D.keyframes[0].t),
    updates: D.entries.slice(D.keyframes[0].index + 1) });
  D.replayLog = (log) => {
    if (D.source) { D.source.close(); D.source = null; }
    D.replay = true; D.live = false; $("conn").textContent = "offline (replay)";
    reset(log.snapshot);
    D.replay = true;
    for (const u of log.updates) push(u);
    D.live = false; $("play").disabled = false;
    scrubTo(D.entries.length - 1);
  };

  // ---------------------------------------------------------------- the feed
  function connect() {
    const es = new EventSource("/dashboard/events");
    D.source = es;
    es.addEventListener("snapshot", (e) => { reset(JSON.parse(e.data)); $("conn").textContent = "connected"; });
    es.addEventListener("update", (e) => push(JSON.parse(e.data)));
    es.onerror = async () => {
      $("conn").textContent = "reconnecting";
      const s = await sessionState();  // a 401 (session expired): ask for the key again
      if (s && s.required && !s.valid) { es.close(); askKey("session expired: API key"); }
    };
  }

  // ---------------------------------------------------------------- access (server/dashboard/access.py)
  // With --api-key the page asks for the key, trades it for a short-lived HttpOnly session
  // cookie (EventSource cannot send headers) and keeps the key in memory only, to renew it.
  let apiKey = null;
  async function sessionState() {
    try { const r = await fetch("/dashboard/session", { cache: "no-store" }); return r.ok ? r.json() : null; }
    catch (err) { return null; }
  }
  async function openSession(key) {
    const r = await fetch("/dashboard/session", { method: "POST", headers: { Authorization: `Bearer ${key}` } });
    if (!r.ok) return null;
    const s = await r.json();
    setTimeout(() => { if (apiKey) openSession(apiKey); }, s.ttl_s * 500);  // renew at half-life
    return s;
  }
  function askKey(message) {
    $("conn").textContent = "locked";
    const form = $("keyform"); form.hidden = false; $("keyhint").textContent = message;
    form.onsubmit = async (e) => {
      e.preventDefault();
      const key = $("apikey").value; $("apikey").value = "";
      if (await openSession(key)) { apiKey = key; form.hidden = true; connect(); }
      else askKey("wrong key: API key");
    };
  }
  async function start() {
    const s = await sessionState();
    if (s && s.required && !s.valid) askKey("this server has an API key:"); else connect();
  }

  // ---------------------------------------------------------------- the grid
  const COLORS = { null: [40, 40, 40], free: [217, 221, 227], use1: [127, 179, 255],
    shared: [31, 95, 209], pinned: [155, 63, 212], sel: [224, 36, 94] };
  const NEXT = [255, 140, 26], LAST = [255, 224, 163];
  function packed([r, g, b]) { return (255 << 24) | (b << 16) | (g << 8) | r; }
  const P = Object.fromEntries(Object.entries(COLORS).map(([k, v]) => [k, packed(v)]));
  function layout(n, canvas) {
    const cols = Math.max(1, Math.ceil(Math.sqrt(n * 3))), rows = Math.max(1, Math.ceil(n / cols));
    if (canvas.width !== cols || canvas.height !== rows) { canvas.width = cols; canvas.height = rows; }
    canvas.style.height = Math.max(40, canvas.clientWidth * rows / cols) + "px";
    return { cols, rows };
  }
  function drawPool(canvas, pool, selected) {
    const n = pool.refs.length, { cols, rows } = layout(n, canvas);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(cols, rows), px = new Uint32Array(img.data.buffer);
    const refs = pool.refs;
    px[0] = P.null;
    for (let i = 1; i < n; i++) {
      const r = refs[i];
      px[i] = r === 0 ? P.free : (r === 1 ? P.use1 : P.shared);
    }
    const m = pool.freeOrder.size;
    let rank = 0;
    for (const id of pool.freeOrder.keys()) {
      const f = m > 1 ? rank / (m - 1) : 0;
      px[id] = packed(NEXT.map((c, k) => Math.round(c + (LAST[k] - c) * f)));
      rank++;
    }
    for (const id of pool.pins.keys()) px[id] = P.pinned;
    if (selected) for (const id of selected) if (id > 0 && id < n) px[id] = P.sel;
    ctx.putImageData(img, 0, 0);
  }
  D.drawFrame = () => {
    const t0 = performance.now();
    const s = D.view;
    if (!s) return 0;
    const tbl = D.selectedTable, dev = tbl && tbl.tier === "device" ? tbl.blocks.map((b) => b.physical) : null;
    drawPool($("grid"), s.pools[0], dev);
    $("hostgrid").style.display = s.pools[1] ? "" : "none";
    if (s.pools[1]) drawPool($("hostgrid"), s.pools[1], tbl && tbl.tier === "host" ? tbl.blocks.map((b) => b.physical) : null);
    const c = s.pools[0].counts();
    $("counts").innerHTML = ["usable", "in_use", "cached", "free", "pinned"].map((k) =>
      `<span data-count="${k}">${k.replace("_", " ")}: <b>${c[k]}</b></span>`).join("") +
      `<span data-count="usage">usage: <b>${(100 * c.in_use / Math.max(c.usable, 1)).toFixed(1)}%</b></span>`;
    D.lastFrameMs = performance.now() - t0;
    return D.lastFrameMs;
  };
  D.measureFrames = (n) => { let total = 0; for (let i = 0; i < n; i++) total += D.drawFrame(); return total / n; };
  $("grid").addEventListener("mousemove", (e) => {
    const s = D.view; if (!s) return;
    const cv = $("grid"), rect = cv.getBoundingClientRect();
    const col = Math.floor((e.clientX - rect.left) / rect.width * cv.width);
    const row = Math.floor((e.clientY - rect.top) / rect.height * cv.height);
    const id = row * cv.width + col, pool = s.pools[0];
    if (id < 0 || id >= pool.refs.length) return;
    const h = pool.hashes[id], node = h && s.forest.get(h);
    let rank = -1, i = 0;
    if (pool.freeOrder.has(id)) for (const k of pool.freeOrder.keys()) { if (k === id) { rank = i; break; } i++; }
    $("hover").textContent = `block ${id}: ref ${pool.refs[id]}` + (h ? ` hash ${h}` : "") +
      (rank >= 0 ? ` eviction rank ${rank}` : "") + (pool.pins.has(id) ? " pinned" : "") +
      (node ? ` hits ${node.hits}` : "");
  });

  // ---------------------------------------------------------------- panels
  function entryAt() { return D.entries[Math.max(0, Math.min(D.viewIndex, D.entries.length - 1))]; }
  function renderRequests() {
    const e = entryAt(); if (!e || !e.queues) return;
    const rows = [];
    for (const q of ["running", "waiting", "swapped"]) for (const [id, tok, comp, cached] of e.queues[q]) {
      rows.push(`<tr class="req${id === D.selected ? " sel" : ""}" data-id="${id}"><td>${id}</td><td>${q}</td><td>${tok}</td><td>${comp}</td><td>${cached}</td></tr>`);
    }
    $("requests").innerHTML = `<table><tr><th>request</th><th>state</th><th>tokens</th><th>computed</th><th>cache hit</th></tr>${rows.join("") || '<tr><td colspan="5" class="hint">no request</td></tr>'}</table>`;
    if (D.live && D.lastQueues) {
      const now = new Set(["running", "waiting", "swapped"].flatMap((q) => e.queues[q].map((r) => r[0])));
      for (const q of ["running", "waiting", "swapped"]) for (const r of D.lastQueues[q]) {
        if (!now.has(r[0]) && !D.finished.includes(r[0])) { D.finished.unshift(r[0]); D.finished.length = Math.min(D.finished.length, 30); }
      }
    }
    D.lastQueues = e.queues;
    for (const id of e.finished || []) {  // finished between two updates too (oldest first)
      if (!D.finished.includes(id)) { D.finished.unshift(id); D.finished.length = Math.min(D.finished.length, 30); }
    }
    $("finished").innerHTML = D.finished.length ? "finished: " + D.finished.map((id) => `<a href="#" data-explain="${id}">${id}</a>`).join(" ") : "";
  }
  async function select(id) {
    D.selected = id;
    const r = await fetch(`/dashboard/api/request/${encodeURIComponent(id)}`);
    if (!r.ok) {  // finished: keep its last table, offer the explanation
      D.selected = null; D.selectedTable = null; D.dirty = true;
      $("bt-title").innerHTML = `${id} finished — <a href="#" data-explain="${id}">why did it miss?</a>`;
      return;
    }
    const t = await r.json();
    D.selectedTable = t;
    $("bt-title").textContent = `${id} (${t.tier}, ${t.blocks.length} blocks of ${t.block_size})`;
    $("block-table").innerHTML = `<table id="bt"><tr><th>logical</th><th>physical</th><th>ref</th><th>hash</th><th></th></tr>` +
      t.blocks.map((b) => `<tr data-logical="${b.logical}"><td>${b.logical}</td><td>${b.null ? "null" : b.physical}</td><td>${b.ref_cnt}</td><td>${b.hash || ""}</td><td>${b.shared ? `<span class="shared">shared ×${b.ref_cnt}</span>` : ""} ${b.pinned ? '<span class="pinned">pinned</span>' : ""}</td></tr>`).join("") + "</table>";
    D.dirty = true;
  }
  $("requests").addEventListener("click", (e) => { const tr = e.target.closest("tr.req"); if (tr) select(tr.dataset.id); });
  async function explain(id) {
    const r = await fetch(`/dashboard/api/explain/${encodeURIComponent(id)}`);
    const body = await r.json();
    if (!r.ok) { $("explain").innerHTML = `<span class="hint">${(body.error || {}).message || r.status}</span>`; return; }
    const rows = body.blocks.map((b) => `<tr><td>${b.index}</td><td>${b.tokens[0]}–${b.tokens[1]}</td><td>${b.where}</td><td class="${b.reason === "hit" ? "r-hit" : b.reason === "evicted" ? "r-evicted" : "r-other"}">${b.reason}</td><td class="why">${b.detail || ""}</td></tr>`);
    if (body.partial_block) rows.push(`<tr><td></td><td>${body.partial_block.tokens.join("–")}</td><td>-</td><td class="r-other">partial_block</td><td class="why">${body.partial_block.detail}</td></tr>`);
    $("explain").innerHTML = `<div class="hint">${id}: ${body.num_device_hit_tokens} of ${body.num_tokens} tokens would hit on the device now</div><table><tr><th>#</th><th>tokens</th><th>where</th><th>reason</th><th></th></tr>${rows.join("")}</table>`;
  }
  $("bt-title").addEventListener("click", (e) => { const a = e.target.closest("a[data-explain]"); if (a) { e.preventDefault(); explain(a.dataset.explain); } });
  $("finished").addEventListener("click", (e) => { const a = e.target.closest("a[data-explain]"); if (a) { e.preventDefault(); explain(a.dataset.explain); } });
  $("explain-go").addEventListener("click", () => explain($("explain-id").value.trim()));

  function renderForest() {
    const s = D.view; if (!s) return;
    const kids = new Map(), roots = [];
    for (const [h, n] of s.forest) {
      if (n.parent && s.forest.has(n.parent)) { if (!kids.has(n.parent)) kids.set(n.parent, []); kids.get(n.parent).push(h); }
      else roots.push(h);
    }
    const now = (entryAt() || {}).t || Date.now() / 1000, lines = [];
    const walk = (h, depth) => {
      if (lines.length > 400) return;
      let chain = 1, cur = h, hits = s.forest.get(h).hits, last = s.forest.get(h).last;
      while ((kids.get(cur) || []).length === 1) { cur = kids.get(cur)[0]; chain++; const n = s.forest.get(cur); hits = Math.max(hits, n.hits); last = Math.max(last, n.last); }
      const k = kids.get(cur) || [];
      lines.push(`${"  ".repeat(depth)}${depth ? "└ " : ""}${h.slice(0, 8)} ${chain} block${chain > 1 ? "s" : ""} hits ${hits}` +
        (last ? ` used ${Math.max(0, now - last).toFixed(0)}s ago` : "") + (k.length > 1 ? `  ◆ shared by ${k.length} branches` : ""));
      for (const c of k) walk(c, depth + 1);
    };
    roots.sort((a, b) => (kids.get(b) || []).length - (kids.get(a) || []).length).forEach((r) => walk(r, 0));
    $("forest").textContent = lines.length ? lines.join("\n") : "(no cached prefix)";
  }
  function renderTiers() {
    const e = entryAt(); if (!e) return;
    const s = D.view, host = s && s.pools[1];
    const rows = [];
    if (host) { const c = host.counts(); rows.push(["host swap pool", c.in_use, c.usable, `${c.in_use}/${c.usable} blocks`]); }
    const most = Math.max(1, ...(e.stats.kv_store_tiers || []).map((t) => t.num_blocks));  // bars relative to the fullest tier
    for (const t of e.stats.kv_store_tiers || []) rows.push([`store: ${t.name}`, t.num_blocks, most, `${t.num_blocks} blocks, ${(t.used_bytes / 1048576).toFixed(1)} MiB, hits ${t.hits} misses ${t.misses}`]);
    $("tiers").innerHTML = rows.map(([n, used, cap, text]) => `<div class="tier"><span style="width:120px">${n}</span><div class="bar"><div style="width:${(100 * used / Math.max(cap, 1)).toFixed(1)}%"></div></div><span>${text}</span></div>`).join("") || '<span class="hint">no host pool or store tier</span>';
  }

  // ---------------------------------------------------------------- charts
  const CHARTS = [
    ["prefix hit rate (device, tokens)", (a, b) => [rate(b.prefix_cache_hits - a.prefix_cache_hits, b.prefix_cache_queries - a.prefix_cache_queries)]],
    ["store tier hit rate", (a, b) => (b.kv_store_tiers || []).map((t, i) => { const o = (a.kv_store_tiers || [])[i] || t; return rate(t.hits - o.hits, t.hits - o.hits + t.misses - o.misses); })],
    ["evictions /s", (a, b, dt) => [(b.num_evictions - a.num_evictions) / dt]],
    ["preemptions /s (swap, recompute)", (a, b, dt) => [(b.num_swaps - a.num_swaps) / dt, ((b.num_preemptions - b.num_swaps) - (a.num_preemptions - a.num_swaps)) / dt]],
    ["KV usage", (a, b) => [b.kv_cache_usage]],
    ["throughput tokens/s (gen, prompt)", (a, b, dt) => [(b.generation_tokens - a.generation_tokens) / dt, (b.prompt_tokens - a.prompt_tokens) / dt]],
    ["TTFT mean s", (a, b) => [b.ttft_count > a.ttft_count ? (b.ttft_sum - a.ttft_sum) / (b.ttft_count - a.ttft_count) : NaN]],
  ];
  function rate(n, d) { return d > 0 ? n / d : NaN; }
  $("charts").innerHTML = CHARTS.map(([name], i) => `<div class="chart"><b>${name}</b> <span id="cv${i}"></span><canvas id="ch${i}" width="300" height="90"></canvas></div>`).join("");
  const SERIES = ["#1f5fd1", "#d1331f", "#3aa675", "#9b3fd4"];
  function renderCharts() {
    const E = D.entries, end = Math.min(D.viewIndex, E.length - 1);
    CHARTS.forEach(([, fn], ci) => {
      const cv = $(`ch${ci}`), ctx = cv.getContext("2d");
      ctx.clearRect(0, 0, cv.width, cv.height);
      const pts = [];
      for (let i = RATE_LAG; i < E.length; i++) {
        const a = E[i - RATE_LAG].stats, b = E[i].stats, dt = Math.max(E[i].t - E[i - RATE_LAG].t, 1e-3);
        pts.push(fn(a, b, dt));
      }
      let max = 0;
      for (const p of pts) for (const v of p) if (Number.isFinite(v)) max = Math.max(max, v);
      max = max || 1;
      const nSeries = pts.reduce((m, p) => Math.max(m, p.length), 0);
      for (let s = 0; s < nSeries; s++) {
        ctx.strokeStyle = SERIES[s % SERIES.length]; ctx.beginPath();
        let started = false;
        pts.forEach((p, i) => {
          const v = p[s]; if (!Number.isFinite(v)) { started = false; return; }
          const x = pts.length > 1 ? i / (pts.length - 1) * cv.width : 0, y = cv.height - 4 - v / max * (cv.height - 8);
          if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
        });
        ctx.stroke();
      }
      const cur = end - RATE_LAG >= 0 ? pts[end - RATE_LAG] : null;
      if (pts.length && end >= RATE_LAG) { const x = (end - RATE_LAG) / Math.max(pts.length - 1, 1) * cv.width; ctx.strokeStyle = "#0005"; ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, cv.height); ctx.stroke(); }
      $(`cv${ci}`).textContent = cur ? cur.map((v) => Number.isFinite(v) ? (Math.abs(v) < 10 ? v.toFixed(3) : v.toFixed(0)) : "–").join(" / ") : "";
    });
  }

  // ---------------------------------------------------------------- controls and loop
  $("scrubber").addEventListener("input", (e) => scrubTo(Number(e.target.value)));
  $("live").addEventListener("click", () => { if (D.replay) return; scrubTo(D.entries.length - 1); });
  $("save").addEventListener("click", () => {
    const blob = new Blob([JSON.stringify(D.recordedLog())], { type: "application/json" });
    const a = document.createElement("a"); a.href = URL.createObjectURL(blob); a.download = "pagedkv-dashboard-log.json"; a.click();
  });
  $("load").addEventListener("change", async (e) => {
    const f = e.target.files[0]; if (!f) return;
    const log = JSON.parse(await f.text()); e.target.value = "";
    if (D.source && !D.replay) replayBeside(log); else D.replayLog(log);
  });
  // A log (saved here, or written by `pagedkv simulate --event-log`) loaded in a live page
  // replays in a window of its own, beside the live run, which goes on.
  function replayBeside(log) {
    const w = window.open("/dashboard?offline&replay", "_blank");
    if (!w) { D.replayLog(log); return; }  // pop-ups blocked: replay here instead
    const ready = (ev) => {
      if (ev.source !== w || ev.origin !== location.origin || ev.data !== "pagedkv-replay-ready") return;
      window.removeEventListener("message", ready);
      w.postMessage({ pagedkvLog: log }, location.origin);
    };
    window.addEventListener("message", ready);
  }
  if (new URLSearchParams(location.search).has("replay") && window.opener) {
    window.addEventListener("message", (ev) => {
      if (ev.origin === location.origin && ev.data && ev.data.pagedkvLog) D.replayLog(ev.data.pagedkvLog);
    });
    window.opener.postMessage("pagedkv-replay-ready", location.origin);
  }
  $("play").addEventListener("click", () => {
    let i = 0;
    const step = () => { if (i >= D.entries.length) return; scrubTo(i); $("scrubber").value = i; const next = D.entries[i + 1]; const wait = next ? (next.t - D.entries[i].t) * 1000 : 0; i++; setTimeout(step, Math.min(Math.max(wait, 10), 1000)); };
    step();
  });
  let lastPanels = 0;
  function frame(now) {
    if (D.dirty && D.view) {
      D.dirty = false;
      D.drawFrame();
      const sc = $("scrubber"); sc.max = Math.max(D.entries.length - 1, 0); if (D.live) sc.value = sc.max;
      const e = entryAt(); $("scrubtime").textContent = e ? new Date(e.t * 1000).toLocaleTimeString() : "";
      if (now - lastPanels > 250) { lastPanels = now; renderRequests(); renderTiers(); renderCharts(); renderForest(); }
    }
    requestAnimationFrame(frame);
  }
  setInterval(() => { if (D.selected && D.live && !D.replay) select(D.selected); }, 1000);
  requestAnimationFrame(frame);
  if (!new URLSearchParams(location.search).has("offline")) start();
})();
