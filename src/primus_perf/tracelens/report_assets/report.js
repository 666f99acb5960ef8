"use strict";
// primus-perf report renderer: vanilla JS + SVG, no external resources.
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const SVGNS = "http://www.w3.org/2000/svg";
  const F = PrimusFormat;
  const color = (c) => (DATA.colors || {})[c] || "#999";

  function el(tag, attrs, children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else if (k === "cls") e.className = v; else e.setAttribute(k, v);
    }
    (children || []).forEach((c) => e.appendChild(typeof c === "string" ? document.createTextNode(c) : c));
    return e;
  }
  function sv(tag, attrs, parent) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    if (parent) parent.appendChild(e);
    return e;
  }
  const fmt = (v) => F.num(v), pct = F.pct, spct = F.spct;
  function section(title, note) {
    const s = el("section", {}, [el("h2", { text: title })]);
    if (note) s.appendChild(el("div", { cls: "muted", text: note }));
    document.querySelector("main").appendChild(s);
    return s;
  }
  const chip = (c) => el("i", { cls: "chip", style: "background:" + color(c), "data-color": color(c) });
  function legend(cats, labels) {
    return el("div", { cls: "legend" }, cats.map((c) => el("span", { "data-category": c }, [chip(c), (labels || {})[c] || c])));
  }
  // a category column: the category's colour chip, then its name
  const catCol = (key) => ({ key, label: "category", html: (v) => el("span", { "data-category": v }, [chip(v), v]) });

  // ------------------------------------------------------------------ sortable table
  function table(parent, columns, rows, opts) {
    opts = opts || {};
    const wrap = el("div");
    const filter = el("input", { cls: "filter", type: "search", placeholder: "filter rows (substring, any column)" });
    const tbl = el("table", { cls: "sortable", "data-rows": String(rows.length), "data-table": opts.name || "" });
    const thead = el("thead"), tbody = el("tbody");
    const tr = el("tr");
    columns.forEach((c, i) => {
      const th = el("th", { cls: c.num ? "num" : "", text: c.label, "data-col": String(i) });
      th.addEventListener("click", () => sortBy(i));
      tr.appendChild(th);
    });
    thead.appendChild(tr); tbl.appendChild(thead); tbl.appendChild(tbody);
    const cellText = (c, r) => (c.fmt ? c.fmt(r[c.key], r) : fmt(r[c.key]));
    let state = { col: -1, dir: 1 };
    let view = rows.slice();
    function draw() {
      tbody.textContent = "";
      const q = filter.value.trim().toLowerCase();
      view.forEach((r) => {
        const cells = columns.map((c) => cellText(c, r));
        if (q && !cells.join(" ").toLowerCase().includes(q)) return;
        const row = el("tr");
        columns.forEach((c, i) => {
          const td = el("td", { cls: c.num ? "num" : c.wrap ? "wrap" : "" });
          if (c.html) td.appendChild(c.html(r[c.key], r)); else td.textContent = cells[i];
          if (c.num) td.setAttribute("data-v", String(r[c.key] === null || r[c.key] === undefined ? "" : r[c.key]));
          row.appendChild(td);
        });
        tbody.appendChild(row);
        const more = opts.detail ? opts.detail(r) : null;
        if (more) {
          row.className = "expandable";
          const sub = el("tr", { cls: "detail" }, [el("td", { colspan: String(columns.length) }, [more])]);
          sub.hidden = true;
          row.addEventListener("click", () => { sub.hidden = !sub.hidden; row.classList.toggle("open", !sub.hidden); });
          tbody.appendChild(sub);
        }
      });
    }
    function sortBy(i) {
      const c = columns[i];
      state = { col: i, dir: state.col === i ? -state.dir : (c.num ? -1 : 1) };
      const k = c.key, dir = state.dir;
      view = rows.slice().sort((a, b) => {
        const x = a[k], y = b[k];
        const xn = x === null || x === undefined, yn = y === null || y === undefined;
        if (xn || yn) return xn === yn ? 0 : (xn ? 1 : -1);
        if (typeof x === "number" && typeof y === "number") return dir * (x - y);
        return dir * String(x).localeCompare(String(y));
      });
      thead.querySelectorAll("th").forEach((th, j) => { th.className = (columns[j].num ? "num " : "") + (j === i ? (dir > 0 ? "asc" : "desc") : ""); });
      draw();
    }
    filter.addEventListener("input", draw);
    wrap.appendChild(filter);
    wrap.appendChild(el("div", { cls: "tablewrap" }, [tbl]));
    parent.appendChild(wrap);
    tbl.resetSort = () => { state = { col: -1, dir: 1 }; view = rows.slice(); if (opts.sortCol !== undefined) sortBy(opts.sortCol); else { thead.querySelectorAll("th").forEach((th, j) => { th.className = columns[j].num ? "num" : ""; }); draw(); } };
    tbl.resetSort();
    return tbl;
  }

  // ------------------------------------------------------------------ charts
  function stackedBars(parent, rows, cats, opts) {
    // rows: [{label, values: {cat: ms}}]; horizontal stacked bars.
    const W = 900, rowH = 18, left = 190, right = 70, top = 10;
    const H = top + rows.length * rowH + 30;
    const max = Math.max(1e-9, ...rows.map((r) => cats.reduce((s, c) => s + (r.values[c] || 0), 0)));
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": opts.name });
    const sx = (v) => (v / max) * (W - left - right);
    rows.forEach((r, i) => {
      const y = top + i * rowH;
      sv("text", { x: left - 6, y: y + 12, "text-anchor": "end", text: r.label }, svg);
      let x = left;
      cats.forEach((c) => {
        const v = r.values[c] || 0;
        if (v <= 0) return;
        const w = sx(v);
        const rect = sv("rect", { x, y: y + 2, width: Math.max(w, 0.5), height: rowH - 4, fill: color(c), "data-mark": "1" }, svg);
        sv("title", { text: `${r.label} ${(opts.labels || {})[c] || c}: ${F.ms(v)}` }, rect);
        x += w;
      });
      const total = r.total !== undefined ? r.total : cats.reduce((s, c) => s + (r.values[c] || 0), 0);
      sv("text", { x: x + 4, y: y + 12, text: F.ms(total) + (r.note ? " " + r.note : "") }, svg);
    });
    sv("line", { x1: left, x2: left, y1: top, y2: H - 28, stroke: "#888" }, svg);
    sv("text", { x: left, y: H - 8, text: opts.axis || "GPU kernel time per step (ms)" }, svg);
    parent.appendChild(legend(cats, opts.labels));
    parent.appendChild(svg);
  }

  function divergingBars(parent, rows, opts) {
    // rows: [{label, delta (ms), rel}] centered at zero.
    const W = 900, rowH = 18, left = 200, right = 150, top = 10;
    const H = top + rows.length * rowH + 30;
    const max = Math.max(1e-9, ...rows.map((r) => Math.abs(r.delta)));
    const mid = left + (W - left - right) / 2, half = (W - left - right) / 2;
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": opts.name });
    rows.forEach((r, i) => {
      const y = top + i * rowH;
      sv("text", { x: left - 6, y: y + 12, "text-anchor": "end", text: r.label }, svg);
      const w = Math.max((Math.abs(r.delta) / max) * half, 0.5);
      const rect = sv("rect", { x: r.delta >= 0 ? mid : mid - w, y: y + 2, width: w, height: rowH - 4,
        fill: r.delta > 0 ? "#d9534f" : "#2fa36b", "data-mark": "1" }, svg);
      sv("title", { text: `${r.label}: ${F.ms(r.delta)} (${spct(r.rel)})` }, rect);
      sv("text", { x: W - right + 4, y: y + 12, text: `${F.ms(r.delta)} ${spct(r.rel)}` }, svg);
    });
    sv("line", { x1: mid, x2: mid, y1: top, y2: H - 28, stroke: "#888" }, svg);
    sv("text", { x: mid, y: H - 8, "text-anchor": "middle", text: opts.axis || "candidate − base (ms per step); red = slower" }, svg);
    parent.appendChild(svg);
  }

  function roofline(parent, rf) {
    const W = 900, H = 420, L = 70, R = 20, T = 16, B = 44;
    const pts = rf.points.filter((p) => p.ai > 0 && p.tflops > 0);
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": "roofline" });
    let xs = pts.map((p) => p.ai), ys = pts.map((p) => p.tflops);
    if (rf.peak_tflops) { ys.push(rf.peak_tflops); if (rf.hbm_tb_s) xs.push(rf.peak_tflops / rf.hbm_tb_s); }
    if (!xs.length) { xs = [1, 1000]; ys = [1, 1000]; }
    const lx0 = Math.floor(Math.log10(Math.min(...xs)) - 0.3), lx1 = Math.ceil(Math.log10(Math.max(...xs)) + 0.3);
    const ly0 = Math.floor(Math.log10(Math.min(...ys)) - 0.3), ly1 = Math.ceil(Math.log10(Math.max(...ys)) + 0.2);
    const X = (v) => L + ((Math.log10(v) - lx0) / (lx1 - lx0)) * (W - L - R);
    const Y = (v) => H - B - ((Math.log10(v) - ly0) / (ly1 - ly0)) * (H - T - B);
    for (let e = lx0; e <= lx1; e++) {
      sv("line", { x1: X(10 ** e), x2: X(10 ** e), y1: T, y2: H - B, stroke: "#eee" }, svg);
      sv("text", { x: X(10 ** e), y: H - B + 14, "text-anchor": "middle", text: fmt(10 ** e, 3) }, svg);
    }
    for (let e = ly0; e <= ly1; e++) {
      sv("line", { x1: L, x2: W - R, y1: Y(10 ** e), y2: Y(10 ** e), stroke: "#eee" }, svg);
      sv("text", { x: L - 6, y: Y(10 ** e) + 4, "text-anchor": "end", text: fmt(10 ** e, 3) }, svg);
    }
    sv("text", { x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle", text: "arithmetic intensity (FLOP/byte)" }, svg);
    sv("text", { x: 14, y: (T + H - B) / 2, transform: `rotate(-90 14 ${(T + H - B) / 2})`, "text-anchor": "middle", text: "achieved TFLOP/s" }, svg);
    if (rf.peak_tflops) {
      const xmin = 10 ** lx0, xmax = 10 ** lx1, P = rf.peak_tflops;
      if (rf.hbm_tb_s) {
        const ridge = P / rf.hbm_tb_s;
        const xa = Math.max(xmin, (10 ** ly0) / rf.hbm_tb_s);
        sv("polyline", { points: `${X(xa)},${Y(xa * rf.hbm_tb_s)} ${X(ridge)},${Y(P)} ${X(xmax)},${Y(P)}`,
          fill: "none", stroke: "#b3261e", "stroke-width": 2, "data-mark": "1" }, svg);
        sv("text", { x: X(ridge) + 6, y: Y(P) - 6, text: `${F.tflops(P)}, ${fmt(rf.hbm_tb_s)} TB/s (${rf.dtype})`, fill: "#b3261e" }, svg);
      } else {
        sv("line", { x1: X(xmin), x2: X(xmax), y1: Y(P), y2: Y(P), stroke: "#b3261e", "stroke-width": 2, "data-mark": "1" }, svg);
      }
    }
    const kinds = { gemm: "#3b6fd8", attention: "#e8793a" };
    pts.forEach((p) => {
      const r = Math.max(3, Math.min(12, 3 + Math.sqrt(p.share || 0) * 18));
      const c = sv("circle", { cx: X(p.ai), cy: Y(p.tflops), r, fill: kinds[p.kind] || "#777", "fill-opacity": 0.75,
        stroke: "#222", "stroke-width": 0.5, "data-mark": "1" }, svg);
      sv("title", { text: `${p.kind} ${p.label}\nAI ${fmt(p.ai)} FLOP/B, ${F.tflops(p.tflops)}, ${pct(p.share)} of GPU time` }, c);
    });
    parent.appendChild(el("div", { cls: "legend" }, [el("span", {}, [el("i", { style: "background:#3b6fd8" }), "GEMM"]),
      el("span", {}, [el("i", { style: "background:#e8793a" }), "attention"]),
      el("span", {}, [el("i", { style: "background:#b3261e" }), "roofs (datasheet)"])]));
    parent.appendChild(svg);
  }

  function timeline(parent, tl) {
    const W = 900, rowH = 22, left = 110, right = 30, top = 8;
    const H = top + tl.streams.length * rowH + 30;
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": "timeline" });
    const span = Math.max(tl.dur_us, 1e-9);
    const X = (t) => left + (t / span) * (W - left - right);
    tl.streams.forEach((s, i) => {
      const y = top + i * rowH;
      sv("text", { x: left - 6, y: y + 14, "text-anchor": "end", text: `stream ${s.stream}` }, svg);
      sv("rect", { x: left, y: y + 3, width: W - left - right, height: rowH - 6, fill: "#f3f4f6" }, svg);
      s.segments.forEach((g) => {
        const cat = tl.categories[g[2]];
        const r = sv("rect", { x: X(g[0]), y: y + 3, width: Math.max(X(g[0] + g[1]) - X(g[0]), 0.6), height: rowH - 6,
          fill: color(cat), "data-mark": "1" }, svg);
        sv("title", { text: `${cat} at ${F.ms(g[0] / 1000)}, ${F.us(g[3])} busy` }, r);
      });
    });
    for (let k = 0; k <= 10; k++) {
      const t = (span * k) / 10;
      sv("text", { x: X(t), y: H - 8, "text-anchor": "middle", text: fmt(t / 1000) }, svg);
    }
    parent.appendChild(legend(tl.categories));
    parent.appendChild(svg);
  }

  // ------------------------------------------------------------------ pages
  function headerCards(cards) {
    const box = document.querySelector(".cards");
    cards.forEach(([label, value, title]) => {  // title: where the value comes from (a tooltip)
      if (value === null || value === undefined || value === "") return;
      box.appendChild(el("div", title ? { cls: "card", title: title } : { cls: "card" },
        [el("b", { text: String(value) }), el("span", { text: label })]));
    });
  }

  const tagCell = (v, r) => {
    if (r.tuned === null || r.tuned === undefined) return document.createTextNode("–");
    return el("span", { cls: "tag " + (r.tuned ? "tuned" : "untuned"), text: r.tuned ? "tuned" : "untuned" });
  };

  function problemColumns(kind) {
    const shapes = { gemm: "problem (m×n×k, transposes, dtype)", attention: "problem (b, hq/hkv, sq/skv, d)",
      grouped_gemm: "problem (pass, groups×[k×n], tokens, skew, dtype)" };
    const cols = [{ key: "shape", label: shapes[kind], wrap: true }];
    if (kind === "attention") cols.push({ key: "direction", label: "pass" });
    cols.push(
      { key: "calls", label: "calls/step", num: true, fmt: F.count },
      { key: "time_ms", label: "time/step", num: true, fmt: F.ms },
      { key: "share", label: "share", num: true, fmt: pct },
      { key: "ai", label: "FLOP/byte", num: true },
      { key: "tflops", label: "TFLOP/s", num: true },
      { key: "pct_roofline", label: "% roofline", num: true, fmt: pct });
    if (DATA.cache) {
      cols.push({ key: "tuned", label: "cache", html: tagCell });
      cols.push({ key: "speedup", label: "cached speedup", num: true, fmt: (v) => (v ? fmt(v) + "×" : "–") });
    }
    return cols;
  }

  const TEMPORAL_LABELS = { compute: "compute", exposed_comm: "exposed communication", exposed_memcpy: "exposed memcpy", idle: "idle" };

  function kernelList(r) {
    if (!r.kernels || !r.kernels.length) return null;
    return el("ul", { cls: "kernels" }, r.kernels.map(([i, share]) =>
      el("li", {}, [el("span", { cls: "share", text: pct(share) }), el("code", { text: DATA.kernel_names[i] })])));
  }

  function commandCell(v) {
    return el("code", { cls: "cmd", text: v, title: "click to select" });
  }

  function reportPage() {
    const h = DATA.header;
    document.querySelector("h1").textContent = DATA.title;
    headerCards([["device", h.device], ["ranks", h.world_size > h.ranks.length ? `${h.ranks.length} of ${h.world_size}` : h.ranks.length],
      ["steps", h.steps], ["GPU step time", h.step_time_ms !== null ? F.ms(h.step_time_ms) : null],
      ["wall-clock step", h.wall_step_time_ms !== null && h.wall_step_time_ms !== undefined ? F.ms(h.wall_step_time_ms) : null,
        h.wall_step_source],
      ["GPU kernel time / step", F.ms(h.gpu_kernel_ms)],
      ["tokens/s", h.tokens_per_s ? fmt(h.tokens_per_s) : null], ["MFU", h.mfu ? pct(h.mfu) : null],
      ["FP8 layers", Object.keys(h.fp8_layers || {}).length ? Object.entries(h.fp8_layers).map(([k, v]) => `${k} ${v}`).join(", ") : null]]);
    const vers = Object.entries(h.versions || {}).map(([k, v]) => `${k} ${v}`).join(" · ");
    document.querySelector(".sub").textContent = (vers ? vers + " · " : "") + (h.traces || []).join(", ");
    if (h.workload) document.querySelector("header").appendChild(el("div", { cls: "muted", text: "workload: " + h.workload }));
    (DATA.notes || []).forEach((n) => document.querySelector("header").appendChild(el("div", { cls: "muted", text: "note: " + n })));

    const parts = Object.keys(TEMPORAL_LABELS);
    const t = DATA.temporal || [];
    if (t.length) {
      const st = section("Step time per rank and step", "The GPU step (first GPU event of the step to the first of the next) split into compute, " +
        "communication not overlapped by compute, copies overlapped by neither, and idle; beside it the wall-clock time of the step on the host.");
      stackedBars(st, t.map((r) => ({ label: r.label, values: r.parts, total: r.span_ms })), parts,
        { name: "temporal", labels: TEMPORAL_LABELS, axis: "GPU step time (ms)" });
      table(st, [{ key: "label", label: "rank / step" }, { key: "span_ms", label: "GPU step", num: true, fmt: F.ms },
        { key: "wall_ms", label: "wall clock (host)", num: true, fmt: F.ms },
        ...parts.map((p) => ({ key: p, label: TEMPORAL_LABELS[p], num: true, fmt: (v, r) => `${F.ms(v)} (${pct(v / r.span_ms)})` }))],
        t.map((r) => Object.assign({ label: r.label, span_ms: r.span_ms, wall_ms: r.wall_ms }, r.parts)), { name: "temporal" });
    }

    if ((DATA.recommendations || []).length || (DATA.measured_unadvised || []).length || DATA.next_note) {
      recommendationsSection(DATA.recommendations || [], DATA.measured_unadvised || [], DATA.next_note);
    }

    if ((DATA.tune_next || []).length) {
      const tn = section("Tune next", "GEMM and attention problems ranked by the time they would save at the roofline (time × (1 − % roofline)); " +
        "each with the command that tunes it (What to do next counts only what the best available kernels reach).");
      const cols = [{ key: "kind", label: "kind" }, { key: "shape", label: "problem", wrap: true },
        { key: "saving_ms", label: "to gain / step", num: true, fmt: F.ms }, { key: "time_ms", label: "time/step", num: true, fmt: F.ms },
        { key: "pct_roofline", label: "% roofline", num: true, fmt: pct }, { key: "calls", label: "calls/step", num: true, fmt: F.count }];
      if (DATA.cache) cols.push({ key: "tuned", label: "cache", html: tagCell });
      cols.push({ key: "command", label: "command", wrap: true, html: commandCell });
      table(tn, cols, DATA.tune_next, { name: "tune-next" });
    }

    const cpuOnly = DATA.header.cpu_only;  // a run without GPU kernels: problems carry their ops' CPU time
    if (!cpuOnly) {
    const s2 = section("Hotspots", "Kernel time per step grouped by (category, op, shape, problem), averaged over steps and ranks; calls are op calls. " +
      "Click a row for its kernels; click a header to sort.");
    table(s2, [catCol("category"), { key: "op", label: "op", wrap: true }, { key: "shape", label: "shape", wrap: true },
      { key: "problem", label: "problem", wrap: true, fmt: (v) => v || "" },
      { key: "calls", label: "calls/step", num: true, fmt: F.count }, { key: "time_ms", label: "time/step", num: true, fmt: F.ms },
      { key: "share", label: "share", num: true, fmt: pct }, { key: "tflops", label: "TFLOP/s", num: true },
      { key: "pct_roofline", label: "% roofline", num: true, fmt: pct }], DATA.hotspots, { sortCol: 5, detail: kernelList, name: "hotspots" });
    }

    if ((DATA.collectives || []).length) {
      const sc = section("Collectives", "Per collective and message size (NCCL's convention: an all-gather's output, a reduce-scatter's input): " +
        "algorithm bandwidth (bytes / kernel time) and bus bandwidth (× NCCL's factor for the collective and group size), the median rank's " +
        "with the range over ranks; start skew across ranks and the rank the others wait for. Kernel time includes waiting for the last rank. " +
        "An all-to-all with split sizes (all_to_allv: expert-parallel dispatch and combine) is one row per group: its message is the mean " +
        "of its calls, its bandwidth the bytes of all its calls over their time.");
      table(sc, [{ key: "collective", label: "collective" },
        { key: "bytes", label: "message", num: true, fmt: (v, r) => (r.sizes > 1 ? `${F.bytes(v)} (mean of ${F.count(r.sizes)} sizes)` : F.bytes(v)) },
        { key: "group_size", label: "group", num: true, fmt: F.count }, { key: "calls", label: "calls/step", num: true, fmt: F.count },
        { key: "time_ms", label: "time/step", num: true, fmt: F.ms }, { key: "mean_us", label: "per call", num: true, fmt: F.us },
        { key: "algbw_gbs", label: "algbw", num: true, fmt: F.gbs }, { key: "busbw_gbs", label: "busbw", num: true, fmt: F.gbs },
        { key: "min_busbw_gbs", label: "busbw range", num: true, fmt: (v, r) => (r.ranks > 1 ? `${fmt(v)} – ${fmt(r.max_busbw_gbs)}` : "–") },
        { key: "max_skew_us", label: "skew (mean / max)", num: true, fmt: (v, r) => (r.ranks > 1 ? `${F.us(r.mean_skew_us)} / ${F.us(v)}` : "–") },
        { key: "last_rank", label: "last to arrive", num: true, fmt: (v) => (v === null || v === undefined ? "–" : "rank " + v) }],
        DATA.collectives, { sortCol: 4, name: "collectives" });
    }
    if ((DATA.collective_ranks || []).length && h.ranks.length > 1) collectiveRanks(DATA.collective_ranks);
    if (DATA.expert_load) expertLoad(DATA.expert_load);

    const b = DATA.breakdown;
    if (b.rows.length) {
      const s1 = section("GPU time by category per step", "Kernel time by category, summed over streams, per rank and step.");
      stackedBars(s1, b.rows.map((r) => ({ label: r.label, values: r.by_cat })), DATA.categories, { name: "breakdown" });
    }

    if (DATA.roofline.points.length || DATA.roofline.peak_tflops) {  // a CPU run has neither: no empty chart
      const s3 = section("Roofline", DATA.roofline.peak_tflops ? "Each GEMM and attention problem; circle area ∝ share of GPU time." :
        "Device peaks unknown: problems are shown without roofs.");
      roofline(s3, DATA.roofline);
    }

    const cpuNote = cpuOnly ? "A CPU run: times are the ops' CPU times, shares are of the problems' total. " : "";
    const s4 = section("GEMM problems", cpuNote + (DATA.cache ? `Tuning cache: ${DATA.cache.path} (${DATA.cache.entries} entries` +
      (DATA.cache.versions_unchecked ? `; ${DATA.cache.versions_unchecked} matched by device only: the run did not record their libraries` : "") + ")" : ""));
    table(s4, problemColumns("gemm"), DATA.gemm, { sortCol: 2, name: "gemm" });
    const s5 = section("Attention problems", cpuNote);
    table(s5, problemColumns("attention"), DATA.attention, { sortCol: 3, name: "attention" });
    if ((DATA.grouped_gemm || []).length) {
      const sg = section("Grouped GEMM problems", cpuNote + "MoE expert GEMMs, one row per pass; tokens and skew are the buckets " +
        "the tuner keys on, FLOP/s are from each call's exact tokens.");
      table(sg, problemColumns("grouped_gemm"), DATA.grouped_gemm, { sortCol: 2, name: "grouped-gemm" });
    }

    if (DATA.timeline && DATA.timeline.streams.length) {
      const tl = DATA.timeline;
      const s6 = section(`Kernel timeline: rank ${tl.rank}, step ${tl.step}`,
        `Per stream, in ${F.us(tl.resolution_us)} bins: each run of bins coloured by the category with most kernel time; time axis in ms.`);
      timeline(s6, tl);
    }
    // the detail sections after the overview ones: host side, kernel resources, memory
    if (DATA.host) hostSection(DATA.host);
    if ((DATA.kernel_efficiency || []).length) efficiencySection(DATA.kernel_efficiency);
    if (DATA.memory) memorySection(DATA.memory);
  }

  // what to do next (report.next_steps, what primus-profile analyze prints): the recommendations,
  // the step tuner's measurements of levers none names, why there is none
  function recommendationsSection(rows, measured, note) {
    const s = section("What to do next", rows.length ? "Ranked by the time each change could save per step (changes of " +
      "the numerics last: FP8, lower precision). Each estimate says how it was made; they do not add up where two touch " +
      "the same kernels." : "");
    s.setAttribute("id", "recommendations");
    const list = el("ol", { cls: "recs" });
    rows.forEach((r) => {
      const items = [el("div", {}, [el("b", { text: r.category }), " · save ~" + F.ms(r.estimated_saving_ms) + " per step" +
        (r.measured_saving_ms !== null && r.measured_saving_ms !== undefined ? " · measured " + F.ms(r.measured_saving_ms) +
          (r.measured_against && r.measured_against !== "the default" ? " against " + r.measured_against : "") : "") +
        (r.changes_numerics ? " · changes the numerics" : "")]),
        el("div", { text: "evidence: " + r.evidence }), el("div", { text: "because: " + r.condition }),
        el("div", {}, [el("b", { text: "do: " }), r.action])];
      if (r.command) items.push(el("div", {}, ["run: ", commandCell(r.command)]));
      items.push(el("div", { cls: "muted", text: "estimate: " + r.method }));
      list.appendChild(el("li", {}, items));
    });
    if (rows.length) s.appendChild(list);
    if (note) s.appendChild(el("p", { text: note }));
    if (measured.length) {
      s.appendChild(el("h3", { text: "Measured by the step tuner (step_plan.json), levers not estimated here" }));
      table(s, [{ key: "lever", label: "lever", wrap: true }, { key: "against", label: "against", wrap: true },
        { key: "speedup", label: "speedup", num: true, fmt: (v) => (v === null || v === undefined ? "–" : v.toFixed(3) + "x") },
        { key: "measured_ms", label: "saved / step", num: true, fmt: F.ms }, { key: "status", label: "status" }],
        measured, { name: "step-tuner" });
    }
  }

  const PATH_LABELS = { cpu: "host (CPU)", launch: "launch delay", gpu: "GPU kernels", wait: "stream wait" };
  function hostSection(d) {
    const s = section("Host side: critical path and launches", "Critical path of each step: from the step's start on the host to its " +
      "last GPU event, walking back through whatever released each kernel (the previous kernel of its stream, or its launch; on the " +
      "host, back to a synchronizing call and the GPU event it waited for). Host-bound steps have most of it on the host.");
    s.setAttribute("id", "host");
    if (d.critical_path.length) {
      stackedBars(s, d.critical_path.map((r) => ({ label: r.label, values: r.parts, total: r.path_ms })), Object.keys(PATH_LABELS),
        { name: "critical-path", labels: PATH_LABELS, axis: "critical path (ms)" });
      table(s, [{ key: "label", label: "rank / step" }, { key: "path_ms", label: "path", num: true, fmt: F.ms },
        ...Object.keys(PATH_LABELS).map((p) => ({ key: p, label: PATH_LABELS[p], num: true, fmt: (v, r) => `${F.ms(v)} (${pct(v / r.path_ms)})` })),
        { key: "events", label: "GPU events on path", num: true, fmt: F.count }],
        d.critical_path.map((r) => Object.assign({ label: r.label, path_ms: r.path_ms, events: r.events }, r.parts)), { name: "critical-path" });
    }
    if (d.launches.length) {
      s.appendChild(el("h3", { text: "Kernel launches per step" }));
      table(s, [{ key: "label", label: "rank / step" }, { key: "launches", label: "launches", num: true, fmt: F.count },
        { key: "launch_ms", label: "launch calls", num: true, fmt: F.ms }, { key: "call_p50_us", label: "call p50", num: true, fmt: F.us },
        { key: "delay_p50_us", label: "launch→start p50", num: true, fmt: F.us }, { key: "delay_p90_us", label: "p90", num: true, fmt: F.us },
        { key: "delay_max_us", label: "max", num: true, fmt: F.us }, { key: "queue_p50", label: "queue p50", num: true, fmt: F.count },
        { key: "queue_max", label: "queue max", num: true, fmt: F.count }], d.launches, { name: "launches" });
      const total = d.delays.reduce((x, r) => x + r.launches, 0) || 1;
      s.appendChild(el("h3", { text: "Launch-to-start delay distribution" }));
      table(s, [{ key: "bin", label: "delay" }, { key: "launches", label: "launches", num: true, fmt: F.count },
        { key: "share", label: "share", num: true, fmt: pct }],
        d.delays.map((r) => ({ bin: `${F.us(r.lo_us)} – ${r.hi_us === null ? "∞" : F.us(r.hi_us)}`, launches: r.launches, share: r.launches / total })),
        { name: "launch-delays" });
    }
    if (d.syncs && d.syncs.length) {
      s.appendChild(el("h3", { text: "Synchronizing calls (per step): the host waits for the GPU, the queue drains, the GPU idles until the host refills it" }));
      table(s, [{ key: "site", label: "call site", wrap: true }, { key: "call", label: "runtime call" },
        { key: "calls", label: "calls/step", num: true, fmt: F.count }, { key: "wait_ms", label: "host wait", num: true, fmt: F.ms },
        { key: "idle_after_ms", label: "GPU idle after", num: true, fmt: F.ms }], d.syncs, { name: "syncs" });
    }
    if (d.ops.length) {
      s.appendChild(el("h3", { text: "CPU against GPU time per op (per step)" }));
      table(s, [{ key: "op", label: "op", wrap: true }, { key: "calls", label: "calls/step", num: true, fmt: F.count },
        { key: "cpu_ms", label: "CPU", num: true, fmt: F.ms }, { key: "cpu_self_ms", label: "CPU self", num: true, fmt: F.ms },
        { key: "gpu_self_ms", label: "GPU self", num: true, fmt: F.ms }, { key: "gpu_ms", label: "GPU inclusive", num: true, fmt: F.ms }],
        d.ops, { name: "cpu-ops" });
    }
  }

  function efficiencySection(rows) {
    const s = section("Kernel efficiency", "Launch resources Kineto records per kernel: grid, block, registers per thread, shared memory, " +
      "blocks per SM and its estimated achieved occupancy (time-weighted). Flagged: kernels with ≥1% of the time at <25% occupancy or with " +
      "fewer blocks than SMs (GEMM and attention kernels often run one large block per SM by design).");
    s.setAttribute("id", "kernel-efficiency");
    table(s, [{ key: "name", label: "kernel", wrap: true }, catCol("category"), { key: "launches", label: "launches/step", num: true, fmt: F.count },
      { key: "time_ms", label: "time/step", num: true, fmt: F.ms }, { key: "share", label: "share", num: true, fmt: pct },
      { key: "grid", label: "grid" }, { key: "block", label: "block" }, { key: "registers", label: "regs", num: true, fmt: F.count },
      { key: "shared_bytes", label: "shared mem", num: true, fmt: F.bytes }, { key: "blocks_per_sm", label: "blocks/SM", num: true, fmt },
      { key: "occupancy_pct", label: "occupancy", num: true, fmt: (v) => (v === null || v === undefined ? "–" : fmt(v) + "%") },
      { key: "flag", label: "flag" }], rows, { name: "kernel-efficiency" });
  }

  function memorySection(d) {
    const s = section("Memory", "Allocated bytes over the profiled window, from the trace's [memory] events (profile_memory=True); " +
      "allocations per op are the ones made while it was the innermost op on the allocating thread.");
    s.setAttribute("id", "memory");
    d.devices.forEach((dev) => {
      if (!dev.points.length) return;
      s.appendChild(el("h3", { text: `${dev.label}: peak ${F.bytes(dev.peak_bytes)} at ${F.ms(dev.peak_ms)}` +
        (dev.relative ? " (relative to the first event: the trace records no totals)" : "") }));
      const W = 900, H = 180, P = 40;
      const xs = dev.points.map((p) => p[0]), ys = dev.points.map((p) => p[1]);
      const x1 = Math.max(...xs) || 1, y0 = Math.min(0, ...ys), y1 = Math.max(...ys) || 1;
      const svg = sv("svg", { width: W, height: H, "data-chart": "memory", class: "chart" }, s);
      const X = (x) => P + (W - 2 * P) * x / x1, Y = (y) => H - 20 - (H - 40) * (y - y0) / (y1 - y0 || 1);
      const line = dev.points.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
      sv("polygon", { fill: "#4c78a8", "fill-opacity": 0.4, stroke: "none",
        points: `${X(xs[0]).toFixed(1)},${Y(y0).toFixed(1)} ${line} ${X(xs[xs.length - 1]).toFixed(1)},${Y(y0).toFixed(1)}` }, svg);
      sv("polyline", { fill: "none", stroke: "#4c78a8", "stroke-width": 1.5, "data-mark": "1", points: line }, svg);
      sv("line", { x1: P, x2: W - P, y1: Y(y0), y2: Y(y0), stroke: "#888" }, svg);
      sv("text", { x: 4, y: 14, text: F.bytes(y1), "font-size": 11 }, svg);
      sv("text", { x: W - P, y: H - 4, text: F.ms(x1), "font-size": 11, "text-anchor": "end" }, svg);
    });
    if (d.by_op.length) {
      table(s, [{ key: "op", label: "op", wrap: true }, { key: "allocations", label: "allocations", num: true, fmt: F.count },
        { key: "bytes", label: "bytes allocated", num: true, fmt: F.bytes }, { key: "largest", label: "largest", num: true, fmt: F.bytes }],
        d.by_op, { name: "memory-by-op" });
    }
  }

  function collectiveRanks(rows) {
    const s = section("Collectives per rank", "Per rank and collective, every message size together, per step: kernel time, bytes " +
      "(the message in NCCL's convention, and the rank's input and output: what an all-to-all sends and receives) and bandwidth " +
      "(message bytes over kernel time). all_to_allv is the all-to-all with split sizes of expert-parallel dispatch and combine: " +
      "a rank whose experts receive more tokens receives more bytes.");
    table(s, [{ key: "collective", label: "collective" }, { key: "group_size", label: "group", num: true, fmt: F.count },
      { key: "rank", label: "rank", num: true, fmt: F.count }, { key: "calls", label: "calls/step", num: true, fmt: F.count },
      { key: "time_ms", label: "time/step", num: true, fmt: F.ms }, { key: "bytes", label: "bytes/step", num: true, fmt: F.bytes },
      { key: "in_bytes", label: "input (sent)/step", num: true, fmt: F.bytes },
      { key: "out_bytes", label: "output (received)/step", num: true, fmt: F.bytes },
      { key: "algbw_gbs", label: "algbw", num: true, fmt: F.gbs }, { key: "busbw_gbs", label: "busbw", num: true, fmt: F.gbs }],
    rows, { name: "collective-ranks" });
  }

  // per MoE layer, one bar per expert: its mean tokens per step, scaled to the layer's busiest; dashed line: the mean
  function expertBars(parent, layers) {
    const W = 900, rowH = 30, left = 90, right = 120, top = 6;
    const H = top + layers.length * rowH + 24;
    const svg = sv("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-chart": "expert-load" });
    layers.forEach((l, i) => {
      const y = top + i * rowH, h = rowH - 8, bw = (W - left - right) / l.load.length;
      const max = Math.max(1e-9, ...l.load), mean = l.load.reduce((a, b) => a + b, 0) / l.load.length;
      sv("text", { x: left - 6, y: y + h / 2 + 4, "text-anchor": "end", text: `layer ${l.layer}` }, svg);
      l.load.forEach((v, e) => {
        const bh = (v / max) * h;
        const r = sv("rect", { x: left + e * bw, y: y + h - bh, width: Math.max(bw - (bw > 3 ? 1 : 0), 0.5), height: Math.max(bh, 0.5),
          fill: v === 0 ? "#d9534f" : "#3b6fd8", "data-mark": "1" }, svg);
        sv("title", { text: `layer ${l.layer}, expert ${e}: ${fmt(v)} tokens/step (${fmt(mean > 0 ? v / mean : null)}× the mean)` }, r);
      });
      const my = y + h - (mean / max) * h;
      sv("line", { x1: left, x2: W - right, y1: my, y2: my, stroke: "#222", "stroke-dasharray": "3 2", "stroke-width": 0.8 }, svg);
      sv("text", { x: W - right + 6, y: y + h / 2 + 4, text: `max/mean ${fmt(l.imbalance)}` }, svg);
    });
    sv("text", { x: left, y: H - 6, text: "experts in order; bar height: mean tokens per step (red: no token); dashed: the mean" }, svg);
    parent.appendChild(svg);
  }

  function expertLoad(d) {
    const s = section("Expert load", "Tokens each routed expert received over the profiled steps, as the run recorded them " +
      "(the whole data-parallel batch; a token counts once per expert it is routed to). max/mean 1.0 is perfect balance; " +
      "the slowest expert sets the time of a layer's grouped GEMMs.");
    s.appendChild(el("p", { text: d.summary }));
    expertBars(s, d.layers);
    table(s, [{ key: "layer", label: "layer", num: true, fmt: F.count }, { key: "experts", label: "experts", num: true, fmt: F.count },
      { key: "tokens", label: "tokens/step", num: true, fmt: F.count }, { key: "min", label: "min/expert", num: true },
      { key: "median", label: "median/expert", num: true }, { key: "max", label: "max/expert", num: true },
      { key: "imbalance", label: "max/mean", num: true }, { key: "worst_step_imbalance", label: "worst step max/mean", num: true },
      { key: "idle", label: "idle experts", num: true, fmt: F.count }], d.layers, { name: "expert-load" });
  }

  function diffPage() {
    document.querySelector("h1").textContent = DATA.title;
    const h = DATA.header;
    headerCards([["base / step", F.ms(h.base_step_ms)], ["candidate / step", F.ms(h.candidate_step_ms)],
      ["change", spct(h.step_change)], ["device", h.device], ["world size", h.world_size]]);
    document.querySelector(".sub").textContent = `base: ${h.base} · candidate: ${h.candidate}`;
    const s0 = section("Verdict");
    s0.appendChild(el("div", { cls: "verdict", text: DATA.verdict }));
    (DATA.warnings || []).forEach((w) => s0.appendChild(el("div", { cls: "warning", text: "warning: " + w })));
    const s1 = section("Per-step time", "Step time (first GPU event of the step to the first of the next; the last step to its last event's end), averaged over ranks, by step index.");
    table(s1, [{ key: "step", label: "step index", num: true }, { key: "base_ms", label: "base", num: true, fmt: F.ms },
      { key: "candidate_ms", label: "candidate", num: true, fmt: F.ms }, { key: "rel", label: "change", num: true, fmt: spct }], DATA.steps, {});
    const s2 = section("Breakdown deltas", "Per category, per step.");
    divergingBars(s2, DATA.breakdown.map((r) => ({ label: r.category, delta: r.delta_ms, rel: r.rel })), { name: "breakdown-delta" });
    table(s2, [catCol("category"), { key: "base_ms", label: "base", num: true, fmt: F.ms },
      { key: "candidate_ms", label: "candidate", num: true, fmt: F.ms }, { key: "delta_ms", label: "delta", num: true, fmt: F.ms },
      { key: "rel", label: "change", num: true, fmt: spct }], DATA.breakdown, { sortCol: 3 });
    const s3 = section("Op deltas", "Matched by op family and shape (a GEMM, attention or convolution of one shape is the same work whichever " +
      "library or backend ran it), not by kernel or op name; per step; largest absolute change first.");
    table(s3, [catCol("category"), { key: "family", label: "family" }, { key: "shape", label: "shape", wrap: true },
      { key: "base_op", label: "base op", wrap: true }, { key: "candidate_op", label: "candidate op", wrap: true },
      { key: "base_ms", label: "base", num: true, fmt: F.ms }, { key: "candidate_ms", label: "candidate", num: true, fmt: F.ms },
      { key: "delta_ms", label: "delta", num: true, fmt: F.ms }, { key: "rel", label: "change", num: true, fmt: spct },
      { key: "side", label: "present in" }], DATA.ops, {});
  }

  // ------------------------------------------------------------------ self-check
  function selfCheck() {
    const problems = [];
    document.querySelectorAll("svg.chart").forEach((s) => {
      if (!s.querySelector("[data-mark]")) problems.push(`chart ${s.getAttribute("data-chart")} is empty`);
    });
    document.querySelectorAll("table.sortable").forEach((t, ti) => {
      const ths = Array.from(t.querySelectorAll("th.num"));
      if (!ths.length || t.querySelectorAll("tbody tr:not(.detail)").length < 2) return;
      const th = ths[ths.length > 1 ? 1 : 0], col = Number(th.getAttribute("data-col"));
      for (const want of ["desc", "asc"]) {
        th.click();
        if (th.className.indexOf(want) < 0) th.click();
        const vals = Array.from(t.querySelectorAll("tbody tr:not(.detail)")).map((r) => r.children[col].getAttribute("data-v"))
          .filter((v) => v !== "").map(Number);
        for (let i = 1; i < vals.length; i++) {
          if (want === "desc" ? vals[i] > vals[i - 1] : vals[i] < vals[i - 1]) { problems.push(`table ${ti} not sorted ${want}`); break; }
        }
      }
      t.resetSort();
    });
    const rects = Array.from(document.querySelectorAll("svg.chart")).map((s) => {
      const r = s.getBoundingClientRect();
      return { name: s.getAttribute("data-chart"), x: Math.round(r.left + window.scrollX), y: Math.round(r.top + window.scrollY),
        w: Math.round(r.width), h: Math.round(r.height) };
    });
    document.documentElement.setAttribute("data-charts", JSON.stringify(rects));
    const sections = Array.from(document.querySelectorAll("section")).map((s) => {
      const r = s.getBoundingClientRect();
      return { title: s.querySelector("h2").textContent, x: Math.round(r.left + window.scrollX), y: Math.round(r.top + window.scrollY),
        w: Math.round(r.width), h: Math.round(r.height) };
    });
    document.documentElement.setAttribute("data-sections", JSON.stringify(sections));
    const charts = document.querySelectorAll("svg.chart").length, tables = document.querySelectorAll("table.sortable").length;
    document.documentElement.setAttribute("data-selfcheck", problems.length ? "fail: " + problems.join("; ") : `ok charts=${charts} tables=${tables}`);
    if (problems.length) console.error("report self-check failed: " + problems.join("; "));
  }

  // ------------------------------------------------------------------ preflight
  // the figures' text comes formatted from Python (checks.format_value): the terminal and the page agree
  const PREFLIGHT_GROUPS = { host: "Host", gpu: "GPU compute and memory", telemetry: "GPU telemetry",
    collective: "Collectives (bus bandwidth)", p2p: "Point-to-point links" };
  function preflightPage() {
    document.querySelector("h1").textContent = DATA.title;
    const c = DATA.counts || {};
    headerCards([["verdict", DATA.passed ? "pass" : "FAIL"], ["ranks", DATA.facts.ranks], ["nodes", DATA.facts.nodes],
      ["checks ok", c.ok || 0], ["flagged", (c.fail || 0) + (c.slow || 0)], ["skipped", c.skipped || 0],
      ["peer threshold", pct(DATA.threshold)]]);
    const vers = Object.entries(DATA.facts.versions || {}).map(([k, v]) => `${k} ${v}`).join(" · ");
    document.querySelector(".sub").textContent = vers;
    (DATA.skipped || []).forEach((n) => document.querySelector("header").appendChild(el("div", { cls: "muted", text: "note: " + n })));
    const failed = DATA.checks.filter((r) => r.status === "fail" || r.status === "slow");
    const v = section("Verdict");
    v.appendChild(el("div", { cls: "verdict", text: DATA.passed ? "every check passed (exit code 0)" :
      `${failed.length} check(s) failed (exit code ${DATA.exit_code})` }));
    failed.forEach((r) => v.appendChild(el("div", { cls: "warning", text: `${r.subject}: ${r.name} ${r.value_text}: ${r.reason}` })));
    const status = (s) => el("span", { cls: "tag " + (s === "ok" ? "tuned" : s === "fail" || s === "slow" ? "untuned" : ""), text: s });
    for (const [group, title] of Object.entries(PREFLIGHT_GROUPS)) {
      const rows = DATA.checks.filter((r) => r.group === group);
      if (!rows.length) continue;
      const s = section(title, rows[0].expected_note ? "expected: " + rows[0].expected_note : "");
      table(s, [
        { key: "name", label: "check" }, { key: "subject", label: "subject" },
        { key: "value", label: "value", num: true, fmt: (x, r) => r.value_text },
        { key: "expected", label: "expected", num: true, fmt: (x, r) => r.expected_text },
        { key: "peer_median", label: "peer median", num: true, fmt: (x, r) => r.peer_text },
        { key: "status", label: "status", html: status }, { key: "reason", label: "why", wrap: true },
      ], rows, { name: "preflight-" + group });
    }
    const hosts = (DATA.facts.per_rank || []).filter((f) => f.host).map((f) => f.host);
    if (hosts.length) {
      const s = section("Hosts", "CPU, memory and the collective libraries' environment variables of each node");
      table(s, [{ key: "hostname", label: "host" }, { key: "cpu_model", label: "CPU", wrap: true },
        { key: "cpus", label: "CPUs", num: true }, { key: "memory_total_bytes", label: "memory", num: true, fmt: F.bytes },
        { key: "envText", label: "environment", wrap: true }],
      hosts.map((h) => Object.assign({}, h, { envText: Object.entries(h.env || {}).map(([k, x]) => `${k}=${x}`).join(" ") || "–" })),
      { name: "preflight-hosts" });
    }
  }

  if (DATA.kind === "diff") diffPage(); else if (DATA.kind === "preflight") preflightPage(); else reportPage();
  selfCheck();
})();
