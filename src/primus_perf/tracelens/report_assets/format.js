"use strict";
// Numbers for people: thousands separators, a few significant digits, units; never 9.2e-3.
// Shared by the report page and its tests (loaded before report.js).
const PrimusFormat = (function () {
  const missing = (v) => v === null || v === undefined || (typeof v === "number" && !isFinite(v));

  // v with `sig` significant digits (at most 4 decimals; below that "<0.0001"), grouped thousands
  function num(v, sig) {
    if (missing(v)) return "–";
    if (typeof v !== "number") return String(v);
    if (v === 0) return "0";
    const a = Math.abs(v), s = sig === undefined ? 3 : sig;
    if (a < 1e-4) return (v < 0 ? "-" : "") + "<0.0001";
    if (a >= Math.pow(10, s - 1)) return Math.round(v).toLocaleString("en-US");
    const decimals = Math.min(4, s - 1 - Math.floor(Math.log10(a)));
    return v.toLocaleString("en-US", { maximumFractionDigits: decimals, minimumFractionDigits: 0 });
  }
  // a count (calls per step): integers as integers, fractions with one decimal
  function count(v) {
    if (missing(v)) return "–";
    return Number.isInteger(v) ? v.toLocaleString("en-US") : v.toLocaleString("en-US", { maximumFractionDigits: 1 });
  }
  // milliseconds; below 0.1 ms in microseconds
  function ms(v) {
    if (missing(v)) return "–";
    if (v !== 0 && Math.abs(v) < 0.1) return num(v * 1000) + " µs";
    return num(v) + " ms";
  }
  function us(v) {
    if (missing(v)) return "–";
    return Math.abs(v) >= 1000 ? ms(v / 1000) : num(v) + " µs";
  }
  const pct = (v) => (missing(v) ? "–" : (v * 100).toFixed(1) + "%");
  const spct = (v) => (missing(v) ? "–" : (v >= 0 ? "+" : "") + (v * 100).toFixed(1) + "%");
  const tflops = (v) => (missing(v) ? "–" : num(v) + " TFLOP/s");
  const gbs = (v) => (missing(v) ? "–" : num(v) + " GB/s");
  // bytes in powers of 1024 (B, KiB, MiB, GiB)
  function bytes(v) {
    if (missing(v)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let x = v, i = 0;
    while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
    return (i === 0 ? String(Math.round(x)) : num(x)) + " " + units[i];
  }
  return { num, count, ms, us, pct, spct, tflops, gbs, bytes };
})();
