// pagedkv dashboard: the SSE feed -> PageState (state.js) -> canvas grid, tiers, requests,
// block table, prefix forest, rate charts, time scrubber, log replay. No build step, no CDN.
// Nothing from the feed, a replayed log, an API answer or an input is parsed as HTML: panels are
// built with dom.js (text nodes and attributes) and textContent.
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
    D.view = D.state; D.viewIndex = -1; D.dirty = true; D.gridExtent = 0;
    const kv = snapshot.kv_cache_dtype ? ` (${snapshot.kv_cache_dtype} KV cache, ${snapshot.block_bytes} B a block)` : "";
    const dp = snapshot.data_parallel_size > 1 ? `, ${snapshot.data_parallel_size} engine cores (blocks: core 0)` : "";
    $("model").textContent = (snapshot.model || "") + kv + dp;
  }
  function push(update) {
    if (update.resync) { reset(update.resync); }
    else D.state.apply(update.ops || [], update.t);
    D.entries.push({ t: update.t, ops: update.ops || [], stats: update.stats, queues: update.queues, finished: update.finished, cores: update.cores });
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
    render(true);  // the last frame's panels at once, not at the next scrub
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
  // One pixel a block, drawn at most MAX_CELL_PX a side: a small pool is a small grid.
  const MAX_CELL_PX = 16;
  function layout(n, canvas) {
    const cols = Math.max(1, Math.ceil(Math.sqrt(n * 3))), rows = Math.max(1, Math.ceil(n / cols));
    if (canvas.width !== cols || canvas.height !== rows) { canvas.width = cols; canvas.height = rows; }
    const room = (canvas.parentElement && canvas.parentElement.clientWidth) || 900;
    const cell = Math.min(MAX_CELL_PX, room / cols);
    canvas.style.width = `${cols * cell}px`; canvas.style.height = `${Math.max(8, rows * cell)}px`;
    return { cols, rows };
  }
  // The blocks the grid shows: up to the highest one used so far (in use, cached or pinned) with
  // room to grow, at least MIN_SHOWN: an idle server's 10,000 never-used blocks are one line of
  // text, not a grey wall. A high-water mark, so the grid does not jump as blocks come and go.
  const MIN_SHOWN = 256;
  function shownBlocks(pool) {
    const n = pool.refs.length;
    let top = 0;
    for (let i = n - 1; i > top; i--) if (pool.refs[i] > 0 || pool.hashes[i] !== null || pool.pins.has(i)) { top = i; break; }
    D.gridExtent = Math.max(D.gridExtent || 0, top);
    const want = Math.max(MIN_SHOWN, Math.ceil((D.gridExtent + 1) * 1.25));
    return Math.min(n, want);
  }
  function drawPool(canvas, pool, selected, shown) {
    const n = shown || pool.refs.length, { cols, rows } = layout(n, canvas);
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
      if (id < n) px[id] = packed(NEXT.map((c, k) => Math.round(c + (LAST[k] - c) * f)));
      rank++;
    }
    for (const id of pool.pins.keys()) if (id < n) px[id] = P.pinned;
    if (selected) for (const id of selected) if (id > 0 && id < n) px[id] = P.sel;
    ctx.putImageData(img, 0, 0);
  }
  D.drawFrame = () => {
    const t0 = performance.now();
    const s = D.view;
    if (!s) return 0;
    const tbl = D.selectedTable, dev = tbl && tbl.tier === "device" ? tbl.blocks.map((b) => b.physical) : null;
    const pool = s.pools[0], shown = shownBlocks(pool);
    drawPool($("grid"), pool, dev, shown);
    $("gridnote").textContent = shown < pool.refs.length
      ? `blocks 0–${shown - 1} of ${pool.refs.length} shown: the other ${pool.refs.length - shown} have never held data`
      : "";
    $("hostgrid").style.display = s.pools[1] ? "" : "none";
    if (s.pools[1]) drawPool($("hostgrid"), s.pools[1], tbl && tbl.tier === "host" ? tbl.blocks.map((b) => b.physical) : null);
    const c = pool.counts();
    $("counts").replaceChildren(...["usable", "in_use", "cached", "free", "pinned"].map((k) =>
      el("span", { "data-count": k }, `${k.replace("_", " ")}: `, el("b", {}, c[k]))),
    el("span", { "data-count": "usage" }, "usage: ", el("b", {}, `${(100 * c.in_use / Math.max(c.usable, 1)).toFixed(1)}%`)));
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
    if (col < 0 || col >= cv.width || id < 0 || id >= pool.refs.length) return;
    const h = pool.hashes[id], node = h && s.forest.get(h);
    let rank = -1, i = 0;
    if (pool.freeOrder.has(id)) for (const k of pool.freeOrder.keys()) { if (k === id) { rank = i; break; } i++; }
    $("hover").textContent = `block ${id}: ref ${pool.refs[id]}` + (h ? ` hash ${h}` : "") +
      (rank >= 0 ? ` eviction rank ${rank}` : "") + (pool.pins.has(id) ? " pinned" : "") +
      (node ? ` hits ${node.hits}` : "");
  });

  // ---------------------------------------------------------------- panels
  function entryAt() { return D.entries[Math.max(0, Math.min(D.viewIndex, D.entries.length - 1))]; }
  const QUEUES = ["running", "waiting", "swapped"];
  function queueOf(e, q) { return (e && e.queues && Array.isArray(e.queues[q])) ? e.queues[q] : []; }
  function renderRequests() {
    const e = entryAt(); if (!e || !e.queues) return;
    const rows = [];
    for (const q of QUEUES) for (const [id, tok, comp, cached] of queueOf(e, q).filter(Array.isArray)) {
      rows.push(el("tr", { class: `req${id === D.selected ? " sel" : ""}`, "data-id": id },
        el("td", {}, id), el("td", {}, q), el("td", {}, tok), el("td", {}, comp), el("td", {}, cached)));
    }
    $("requests").replaceChildren(tableOf(["request", "state", "tokens", "computed", "cache hit"], rows, "no request"));
    const remember = (id) => {
      if (!D.finished.includes(id)) { D.finished.unshift(id); D.finished.length = Math.min(D.finished.length, 30); }
    };
    if (D.live && D.lastQueues) {
      const now = new Set(QUEUES.flatMap((q) => queueOf(e, q).filter(Array.isArray).map((r) => r[0])));
      for (const q of QUEUES) for (const r of queueOf(D.lastQueues, q).filter(Array.isArray)) if (!now.has(r[0])) remember(r[0]);
    }
    D.lastQueues = e;
    for (const id of Array.isArray(e.finished) ? e.finished : []) remember(id);  // finished between two updates too
    $("finished").replaceChildren(...(D.finished.length ? ["finished:", ...D.finished.flatMap((id) =>
      [" ", el("a", { href: "#", "data-explain": id }, id)])] : []));
  }
  // The idle hint: nothing running or waiting in the frame shown.
  function renderIdle() {
    const e = entryAt(), busy = e && QUEUES.some((q) => queueOf(e, q).length);
    const hint = $("idle");
    hint.hidden = Boolean(busy);
    hint.textContent = !e ? "waiting for the first update from the server"
      : D.replay ? "no request running or waiting at this point of the log"
        : "idle: no request running or waiting. Send one (POST /v1/completions or /v1/chat/completions) and its blocks fill the grid; cached prefixes stay until evicted.";
  }
  async function select(id) {
    D.selected = id;
    const r = await fetch(`/dashboard/api/request/${encodeURIComponent(id)}`);
    if (!r.ok) {  // finished: keep its last table, offer the explanation
      D.selected = null; D.selectedTable = null; D.dirty = true;
      $("bt-title").replaceChildren(`${id} finished — `, el("a", { href: "#", "data-explain": id }, "why did it miss?"));
      return;
    }
    const t = await r.json();
    D.selectedTable = t;
    $("bt-title").textContent = `${id} (${t.tier}, ${t.blocks.length} blocks of ${t.block_size})`;
    $("block-table").replaceChildren(tableOf(["logical", "physical", "ref", "hash", ""], t.blocks.map((b) =>
      el("tr", { "data-logical": b.logical }, el("td", {}, b.logical), el("td", {}, b.null ? "null" : b.physical),
        el("td", {}, b.ref_cnt), el("td", {}, b.hash || ""),
        el("td", {}, b.shared ? el("span", { class: "shared" }, `shared ×${b.ref_cnt}`) : null, " ",
          b.pinned ? el("span", { class: "pinned" }, "pinned") : null))), "no block", { id: "bt" }));
    D.dirty = true;
  }
  $("requests").addEventListener("click", (e) => { const tr = e.target.closest("tr.req"); if (tr) select(tr.dataset.id); });
  const REASON_CLASS = { hit: "r-hit", evicted: "r-evicted" };
  async function explain(id) {
    const r = await fetch(`/dashboard/api/explain/${encodeURIComponent(id)}`);
    let body = {};
    try { body = await r.json(); } catch (err) { body = {}; }
    if (!r.ok || !body || !Array.isArray(body.blocks)) {
      const message = (body && body.error && body.error.message) || `HTTP ${r.status}`;
      $("explain").replaceChildren(el("span", { class: "hint" }, message));
      return;
    }
    const tokens = (pair) => (Array.isArray(pair) ? pair.join("–") : "");
    const rows = body.blocks.map((b) => el("tr", {}, el("td", {}, b.index), el("td", {}, tokens(b.tokens)),
      el("td", {}, b.where), el("td", { class: REASON_CLASS[b.reason] || "r-other" }, b.reason),
      el("td", { class: "why" }, b.detail || "")));
    const partial = body.partial_block;
    if (partial) rows.push(el("tr", {}, el("td"), el("td", {}, tokens(partial.tokens)), el("td", {}, "-"),
      el("td", { class: "r-other" }, "partial_block"), el("td", { class: "why" }, partial.detail)));
    $("explain").replaceChildren(
      el("div", { class: "hint" }, `${id}: ${body.num_device_hit_tokens} of ${body.num_tokens} tokens would hit on the device now`),
      tableOf(["#", "tokens", "where", "reason", ""], rows, "no full block"));
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
  // Tiers: the host swap pool and the KV store's tiers; the panel is shown only when one exists.
  function storeTiers(e) { return (e && e.stats && Array.isArray(e.stats.kv_store_tiers)) ? e.stats.kv_store_tiers : []; }
  function renderTiers() {
    const e = entryAt(); if (!e) return;
    const s = D.view, host = s && s.pools[1], tiers = storeTiers(e);
    const rows = [];
    if (host) { const c = host.counts(); rows.push(barOf(c.in_use / Math.max(c.usable, 1), `${c.in_use}/${c.usable} blocks`, "host swap pool")); }
    const most = Math.max(1, ...tiers.map((t) => Number(t.num_blocks) || 0));  // bars relative to the fullest tier
    for (const t of tiers) {
      rows.push(barOf((Number(t.num_blocks) || 0) / most, `${t.num_blocks} blocks, ${(Number(t.used_bytes) / 1048576).toFixed(1)} MiB, hits ${t.hits} misses ${t.misses}`, `store: ${t.name}`));
    }
    $("tiers-panel").hidden = rows.length === 0;
    $("tiers").replaceChildren(...rows);
  }

  // Engine cores (data parallelism): each core's KV usage, running and waiting requests.
  function renderCores() {
    const e = entryAt(), cores = (e && Array.isArray(e.cores)) ? e.cores : [];
    $("cores-panel").hidden = cores.length === 0;
    $("cores").replaceChildren(...cores.map((c) => barOf(c.kv_cache_usage,
      `KV ${(100 * (Number(c.kv_cache_usage) || 0)).toFixed(1)}%, ${c.num_running} running, ${c.num_waiting} waiting, hits ${c.prefix_cache_hits}/${c.prefix_cache_queries} tokens`,
      `core ${c.core}`)));
  }

  // ---------------------------------------------------------------- charts
  // Each chart: its unit, its series' names, the values between two entries' stats `RATE_LAG`
  // apart (a, b; dt seconds) in display units, and whether it applies to this server.
  const pct = (n, d) => (d > 0 ? 100 * n / d : NaN);
  const num = (v) => Number(v) || 0;
  const CHARTS = [
    { name: "prefix hit rate (device, tokens)", unit: "%", series: ["window"], whole: true, none: "no admissions in window",
      fn: (a, b) => [pct(num(b.prefix_cache_hits) - num(a.prefix_cache_hits), num(b.prefix_cache_queries) - num(a.prefix_cache_queries))] },
    { name: "store tier hit rate", unit: "%", series: [], none: "no lookups in window", shown: (b) => storeTiers({ stats: b }).length > 0,
      fn: (a, b) => storeTiers({ stats: b }).map((t, i) => { const o = storeTiers({ stats: a })[i] || t; return pct(num(t.hits) - num(o.hits), num(t.hits) - num(o.hits) + num(t.misses) - num(o.misses)); }) },
    { name: "evictions", unit: "blocks/s", series: ["evicted"],
      fn: (a, b, dt) => [(num(b.num_evictions) - num(a.num_evictions)) / dt] },
    { name: "preemptions", unit: "/s", series: ["swap", "recompute"],
      fn: (a, b, dt) => [(num(b.num_swaps) - num(a.num_swaps)) / dt, ((num(b.num_preemptions) - num(b.num_swaps)) - (num(a.num_preemptions) - num(a.num_swaps))) / dt] },
    { name: "KV usage", unit: "%", series: ["in use"], fn: (a, b) => [100 * num(b.kv_cache_usage)] },
    { name: "throughput", unit: "tokens/s", series: ["generated", "prompt"],
      fn: (a, b, dt) => [(num(b.generation_tokens) - num(a.generation_tokens)) / dt, (num(b.prompt_tokens) - num(a.prompt_tokens)) / dt] },
    { name: "TTFT mean", unit: "s", series: ["mean"], none: "no first token in window",
      fn: (a, b) => [num(b.ttft_count) > num(a.ttft_count) ? (num(b.ttft_sum) - num(a.ttft_sum)) / (num(b.ttft_count) - num(a.ttft_count)) : NaN] },
  ];
  $("charts").replaceChildren(...CHARTS.map((c, i) => el("div", { class: "chart", id: `chart${i}` },
    el("b", {}, `${c.name} (${c.unit})`), " ", el("span", { id: `cv${i}` }),
    el("canvas", { id: `ch${i}`, width: 300, height: 110 }))));
  const SERIES = ["#1f5fd1", "#d1331f", "#3aa675", "#9b3fd4"];
  const AXIS = { left: 44, bottom: 14, top: 6, right: 6 };
  function fmt(v, unit) {
    if (!Number.isFinite(v)) return "–";
    if (unit === "%") return `${v.toFixed(1)}%`;
    const a = Math.abs(v), text = a === 0 ? "0" : a < 0.01 ? v.toExponential(1) : a < 10 ? v.toFixed(3) : v.toFixed(0);
    return `${text} ${unit}`;
  }
  // An axis label: a short number (the unit is in the chart's title), "%" kept.
  function short(v, unit) {
    const a = Math.abs(v), text = a === 0 ? "0" : a >= 1e6 ? `${(v / 1e6).toFixed(1)}M` : a >= 1e3 ? `${(v / 1e3).toFixed(1)}k`
      : a >= 10 ? v.toFixed(0) : a >= 0.01 ? String(Number(v.toFixed(2))) : v.toExponential(0);
    return unit === "%" ? `${text}%` : text;
  }
  function drawAxes(ctx, cv, max, unit, spanS) {
    const { left, bottom, top, right } = AXIS, h = cv.height - bottom, w = cv.width - right;
    ctx.strokeStyle = "#8a93a3"; ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, h); ctx.lineTo(w, h); ctx.stroke();
    ctx.fillStyle = "#4b5565"; ctx.font = "10px system-ui, sans-serif"; ctx.textBaseline = "middle"; ctx.textAlign = "right";
    ctx.fillText(short(max, unit), left - 3, top + 4); ctx.fillText(short(0, unit), left - 3, h - 2);
    ctx.textBaseline = "alphabetic"; ctx.textAlign = "left";
    ctx.fillText(spanS > 0 ? `−${spanS.toFixed(spanS < 10 ? 1 : 0)} s` : "time", left, cv.height - 2);
    ctx.textAlign = "right"; ctx.fillText(D.live ? "now" : "end", w, cv.height - 2);
  }
  function wholeRunHitRate(e) {
    const st = (e && e.stats) || {}, q = num(st.prefix_cache_queries);
    return q > 0 ? `whole run: ${fmt(pct(num(st.prefix_cache_hits), q), "%")}` : "whole run: no admissions yet";
  }
  function renderCharts() {
    const E = D.entries, end = Math.min(D.viewIndex, E.length - 1), last = E.length ? E[E.length - 1].stats || {} : {};
    CHARTS.forEach((chart, ci) => {
      const box = $(`chart${ci}`);
      box.hidden = Boolean(chart.shown && !chart.shown(last));
      if (box.hidden) return;
      const cv = $(`ch${ci}`), ctx = cv.getContext("2d");
      const cw = Math.round(cv.clientWidth) || 300, chh = Math.round(cv.clientHeight) || 110;
      if (cv.width !== cw || cv.height !== chh) { cv.width = cw; cv.height = chh; }  // crisp text: no CSS stretch
      ctx.clearRect(0, 0, cv.width, cv.height);
      const pts = [];
      for (let i = RATE_LAG; i < E.length; i++) {
        const a = E[i - RATE_LAG].stats || {}, b = E[i].stats || {}, dt = Math.max(E[i].t - E[i - RATE_LAG].t, 1e-3);
        pts.push(chart.fn(a, b, dt));
      }
      let max = 0;
      for (const p of pts) for (const v of p) if (Number.isFinite(v)) max = Math.max(max, v);
      max = max || (chart.unit === "%" ? 100 : 1);
      const spanS = pts.length ? E[E.length - 1].t - E[RATE_LAG].t : 0;
      drawAxes(ctx, cv, max, chart.unit, spanS);
      const x0 = AXIS.left, w = cv.width - AXIS.right - x0, y0 = cv.height - AXIS.bottom, h = y0 - AXIS.top;
      const xAt = (i) => x0 + (pts.length > 1 ? i / (pts.length - 1) * w : 0);
      const nSeries = pts.reduce((m, p) => Math.max(m, p.length), 0);
      for (let k = 0; k < nSeries; k++) {
        ctx.strokeStyle = SERIES[k % SERIES.length]; ctx.beginPath();
        let started = false;
        pts.forEach((p, i) => {
          const v = p[k]; if (!Number.isFinite(v)) { started = false; return; }
          const y = y0 - v / max * h;
          if (started) ctx.lineTo(xAt(i), y); else { ctx.moveTo(xAt(i), y); started = true; }
        });
        ctx.stroke();
      }
      const cur = end - RATE_LAG >= 0 ? pts[end - RATE_LAG] : null;
      if (pts.length && end >= RATE_LAG) { const x = xAt(end - RATE_LAG); ctx.strokeStyle = "#0005"; ctx.beginPath(); ctx.moveTo(x, AXIS.top); ctx.lineTo(x, y0); ctx.stroke(); }
      const names = chart.series.length ? chart.series : (cur || []).map((_, k) => (storeTiers({ stats: last })[k] || {}).name || `tier ${k}`);
      const parts = (cur || []).map((v, k) => `${names[k] || ""}: ${Number.isFinite(v) ? fmt(v, chart.unit) : (chart.none || "–")}`);
      if (chart.whole) parts.push(wholeRunHitRate(entryAt()));
      $(`cv${ci}`).textContent = cur || chart.whole ? parts.join(" · ") : "collecting…";
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
  // The grid on every change; the panels at most every PANELS_MS, and never left behind: a
  // change skipped for that stays pending until they are drawn.
  const PANELS_MS = 250;
  let lastPanels = -Infinity, panelsPending = false;
  function render(force) {
    if (!D.view) return;
    D.drawFrame();
    const sc = $("scrubber"); sc.max = Math.max(D.entries.length - 1, 0); if (D.live) sc.value = sc.max;
    const e = entryAt(); $("scrubtime").textContent = e ? new Date(e.t * 1000).toLocaleTimeString() : "";
    const now = performance.now();
    if (force || now - lastPanels >= PANELS_MS) {
      lastPanels = now; panelsPending = false;
      renderIdle(); renderRequests(); renderCores(); renderTiers(); renderCharts(); renderForest();
    } else panelsPending = true;
  }
  function frame() {
    if (D.dirty || panelsPending) { D.dirty = false; render(false); }
    requestAnimationFrame(frame);
  }
  setInterval(() => { if (D.selected && D.live && !D.replay) select(D.selected); }, 1000);
  requestAnimationFrame(frame);
  if (!new URLSearchParams(location.search).has("offline")) start();
})();
