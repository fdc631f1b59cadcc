// Chimes dashboard: draws the run chart (uPlot) and asks before destructive actions.
// Pages work without this file; it only adds the chart and the confirmations.
(function () {
  "use strict";

  function seconds(v) {
    if (v == null) return "";
    if (v < 1) return Math.round(v * 1000) + " ms";
    if (v < 60) return v.toFixed(v < 10 ? 1 : 0) + " s";
    return (v / 60).toFixed(1) + " min";
  }

  function utcClock(epochSeconds) {  // the pages show UTC everywhere
    return new Date(epochSeconds * 1000).toISOString().substring(11, 19);
  }

  function drawRunChart(box) {
    var script = box.parentElement.querySelector("script.chart-data");
    if (!script || typeof uPlot === "undefined") return;
    var data = JSON.parse(script.textContent);
    if (!data.x.length) return;
    box.textContent = "";
    var width = Math.max(box.clientWidth, 300);
    var opts = {
      width: width, height: 180, legend: { show: false }, cursor: { points: { size: 8 } },
      scales: { x: { time: true }, y: { range: function (u, min, max) { return [0, Math.max(max || 0, 0.001) * 1.1]; } } },
      axes: [{ stroke: "#687087", grid: { stroke: "#eef0f4" }, values: function (u, vals) { return vals.map(utcClock); } },
             { stroke: "#687087", grid: { stroke: "#eef0f4" }, size: 60, values: function (u, vals) { return vals.map(seconds); } }],
      series: [
        {},
        { label: "start lag", stroke: "#6941c6", width: 1.5, points: { show: true, size: 5, fill: "#6941c6" }, value: function (u, v) { return seconds(v); } },
        { label: "duration", stroke: "#0e9384", width: 1.5, points: { show: true, size: 5, fill: "#0e9384" }, value: function (u, v) { return seconds(v); } }
      ]
    };
    new uPlot(opts, [data.x, data.lag, data.duration], box);
  }

  function init(root) {
    (root.querySelectorAll ? root : document).querySelectorAll("[data-chart]").forEach(drawRunChart);
  }

  document.addEventListener("submit", function (event) {
    var form = event.target.closest("form[data-confirm]");
    if (form && !window.confirm(form.getAttribute("data-confirm"))) event.preventDefault();
  });

  if (typeof htmx !== "undefined") {
    htmx.onLoad(init);  // the first load, and every part htmx swaps in later
  } else {
    document.addEventListener("DOMContentLoaded", function () { init(document); });
  }
})();
