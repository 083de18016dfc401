// The page-state model: the twin of pagedkv/server/dashboard/state.py (same ops, same rules).
// Per pool: refs, hashes, freeOrder (cached free blocks, rank 0 evicted next: the freeing order
// under LRU, replaced whole by "o" ops under LFU and ARC) and pins; the device pool's prefix
// forest (hash -> node).
"use strict";

class PoolState {
  constructor(snap) {
    this.refs = Int32Array.from(snap.refs);
    this.hashes = snap.hashes.slice();
    this.freeOrder = new Map();
    for (const id of snap.free_order) this.freeOrder.set(id, true);
    this.pins = new Map(Object.entries(snap.pins || {}).map(([k, v]) => [Number(k), v]));
  }
  clone() {
    const c = Object.create(PoolState.prototype);
    c.refs = this.refs.slice(); c.hashes = this.hashes.slice();
    c.freeOrder = new Map(this.freeOrder); c.pins = new Map(this.pins);
    return c;
  }
  counts() {
    let inUse = 0;
    for (let i = 1; i < this.refs.length; i++) if (this.refs[i] > 0) inUse++;
    const cached = this.freeOrder.size;
    return { usable: this.refs.length - 1, free: this.refs.length - 1 - inUse - cached,
             cached, in_use: inUse, pinned: this.pins.size };
  }
}

class PageState {
  constructor(snapshot) {
    this.blockSize = snapshot.block_size;
    this.pools = snapshot.pools.map((s) => new PoolState(s));
    this.forest = new Map();
    const parents = snapshot.parents || {};
    this.pools[0].hashes.forEach((h, id) => {
      if (h !== null) this.forest.set(h, { parent: parents[h] ?? null, block: id, hits: 0, last: 0 });
    });
  }
  clone() {
    const c = Object.create(PageState.prototype);
    c.blockSize = this.blockSize;
    c.pools = this.pools.map((p) => p.clone());
    c.forest = new Map();
    for (const [h, n] of this.forest) c.forest.set(h, { ...n });
    return c;
  }
  apply(ops, now) {
    for (const [kind, p, data] of ops) {
      const pool = this.pools[p];
      if (!pool) continue;
      const { refs, hashes, freeOrder } = pool;
      if (kind === "r") {
        for (let i = 0; i < data.length; i += 2) {
          const id = data[i], ref = data[i + 1], old = refs[id], h = hashes[id];
          refs[id] = ref;
          if (old === 0 && ref > 0) freeOrder.delete(id);
          else if (old > 0 && ref === 0 && h !== null) freeOrder.set(id, true);
          if (ref > old && h !== null && p === 0) {
            const n = this.forest.get(h);
            if (n) { n.hits++; n.last = now; }
          }
        }
      } else if (kind === "e" || kind === "u") {
        for (const id of data) {
          const h = hashes[id];
          hashes[id] = null; freeOrder.delete(id);
          if (p === 0 && h !== null) this.forest.delete(h);
        }
      } else if (kind === "c") {
        for (let i = 0; i < data.length; i += 3) {
          const id = data[i], h = data[i + 1];
          hashes[id] = h;
          if (refs[id] === 0) freeOrder.set(id, true);
          if (p === 0) this.forest.set(h, { parent: data[i + 2], block: id, hits: 0, last: now });
        }
      } else if (kind === "x") {
        hashes.fill(null); freeOrder.clear();
        if (p === 0) this.forest.clear();
      } else if (kind === "p") {
        for (let i = 0; i < data.length; i += 2) {
          if (data[i + 1]) pool.pins.set(data[i], data[i + 1]); else pool.pins.delete(data[i]);
        }
      } else if (kind === "o") {  // LFU / ARC: the policy's exact order, replaced whole
        pool.freeOrder = new Map();
        for (const id of data) pool.freeOrder.set(id, true);
      }
    }
  }
}
window.PageState = PageState;
