// Building the dashboards' DOM from data without ever parsing data as HTML: every string from the
// feed, a replayed log, an API answer or an input becomes a text node or an attribute value.
"use strict";

// el("td", {class: "x", "data-id": id}, "text", child, [more]): an element; props are set with
// setAttribute (never as markup), children are nodes or text (null/undefined/false skipped).
function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v !== null && v !== undefined && v !== false) e.setAttribute(k, String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c !== null && c !== undefined && c !== false) e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

// A table: a header row of `headers`, then `rows` (tr elements), or one hint row when none.
function tableOf(headers, rows, empty, props) {
  const head = headers.length ? el("tr", {}, headers.map((h) => el("th", {}, h))) : null;
  const body = rows.length ? rows : [el("tr", {}, el("td", { colspan: Math.max(headers.length, 1), class: "hint" }, empty))];
  return el("table", props || {}, head, body);
}

// A horizontal bar of fraction `f` (clamped to 0..1) with its label.
function barOf(f, label, name) {
  const frac = Math.min(Math.max(Number(f) || 0, 0), 1);
  return el("div", { class: "tier" }, name === undefined ? null : el("span", { class: "tier-name" }, name),
    el("div", { class: "bar" }, el("div", { style: `width:${(100 * frac).toFixed(1)}%` })),
    el("span", {}, label));
}

window.el = el; window.tableOf = tableOf; window.barOf = barOf;
