// Polls /dashboard/data once a second and redraws one uPlot chart per panel.
"use strict";

const PANELS = [
  {id: "batch", title: "Batch size of the latest step", series: [
    {key: "batch_seqs", label: "sequences", stroke: "#1f77b4"},
    {key: "batch_tokens", label: "tokens", stroke: "#ff7f0e", scale: "tokens"}]},
  {id: "requests", title: "Requests in the engine", series: [
    {key: "running", label: "running", stroke: "#2ca02c"},
    {key: "waiting", label: "waiting", stroke: "#d62728"},
    {key: "preempted", label: "preempted (waiting)", stroke: "#9467bd"}]},
  {id: "kv", title: "KV-cache occupancy (%)", series: [
    {key: "kv_usage", label: "blocks in use %", stroke: "#8c564b", scale: 100}]},
  {id: "throughput", title: "Throughput (tokens/s)", series: [
    {key: "engine_tokens_per_s", label: "engine (prompt + output)", stroke: "#17becf"},
    {key: "output_tokens_per_s", label: "output, finished requests", stroke: "#bcbd22"}]},
  {id: "ttft", title: "Time to first token (ms), sliding window", series: [
    {key: "ttft_p50", label: "p50", stroke: "#1f77b4", scale: 1000},
    {key: "ttft_p90", label: "p90", stroke: "#ff7f0e", scale: 1000},
    {key: "ttft_p99", label: "p99", stroke: "#d62728", scale: 1000}]},
  {id: "tpot", title: "Time per output token (ms), sliding window", series: [
    {key: "tpot_p50", label: "p50", stroke: "#1f77b4", scale: 1000},
    {key: "tpot_p90", label: "p90", stroke: "#ff7f0e", scale: 1000},
    {key: "tpot_p99", label: "p99", stroke: "#d62728", scale: 1000}]},
  {id: "spec", title: "Speculative proposals accepted (%), per sample", series: [
    {key: "spec_acceptance", label: "accepted %", stroke: "#e377c2", scale: 100}]},
  {id: "collective", title: "Tensor parallel: step time in collectives (%), per sample", series: [
    {key: "collective_share", label: "rank 0 in collectives %", stroke: "#7f7f7f", scale: 100}]},
];

const charts = {};  // panel id -> uPlot instance (read by the browser test)
window.llmrtCharts = charts;

function makeChart(panel) {
  const box = document.createElement("div");
  box.className = "chart";
  box.id = "chart-" + panel.id;
  const title = document.createElement("h2");
  title.textContent = panel.title;
  box.appendChild(title);
  document.getElementById("charts").appendChild(box);
  const hasTokens = panel.series.some(s => s.scale === "tokens");
  const opts = {
    width: 520, height: 200,
    scales: {x: {time: true}, y: {range: (u, min, max) => [0, Math.max(1, max)]}},
    axes: [{}, {label: hasTokens ? "sequences" : ""}],
    series: [{}].concat(panel.series.map(s => ({
      label: s.label, stroke: s.stroke, width: 1.5, spanGaps: false,
      scale: s.scale === "tokens" ? "tokens" : "y",
    }))),
  };
  if (hasTokens) {
    opts.scales.tokens = {range: (u, min, max) => [0, Math.max(1, max)]};
    opts.axes.push({scale: "tokens", side: 1, label: "tokens", grid: {show: false}});
  }
  const data = [[]].concat(panel.series.map(() => []));
  charts[panel.id] = new uPlot(opts, data, box);
}

function columns(series, panel) {
  const data = [series.t];
  for (const s of panel.series) {
    const factor = typeof s.scale === "number" ? s.scale : 1;
    data.push(series[s.key].map(v => (v === null ? null : v * factor)));
  }
  return data;
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/data", {cache: "no-store"});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const body = await resp.json();
    document.getElementById("model").textContent = body.model;
    const n = body.series.t.length;
    document.getElementById("status").textContent =
      n + " samples every " + body.interval_s + " s; latency percentiles and output throughput over the last " +
      body.window_s + " s; updated " + new Date().toLocaleTimeString();
    for (const panel of PANELS) charts[panel.id].setData(columns(body.series, panel));
  } catch (e) {
    document.getElementById("status").textContent = "cannot reach the server: " + e.message;
  }
}

for (const panel of PANELS) makeChart(panel);
poll();
setInterval(poll, 1000);
