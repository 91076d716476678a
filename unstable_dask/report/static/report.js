// The page's charts and sortable tables; it runs after the Vega bundle, in the same script element.
(function () {
  "use strict";
  // Charts: each div.vl holds a Vega-Lite spec as JSON in data-spec (data only: model text is never
  // code). ast: Vega's expression interpreter, so the page's CSP needs no 'unsafe-eval'.
  var charts = Array.prototype.map.call(document.querySelectorAll("div.vl"), function (el) {
    var spec = JSON.parse(el.getAttribute("data-spec"));
    return vegaEmbed(el, spec, {mode: "vega-lite", renderer: "svg", actions: false, ast: true})
      .catch(function (e) { console.error("chart: " + e); });
  });
  Promise.all(charts).then(function () { document.body.setAttribute("data-charts", "drawn"); });

  // Sortable tables: click a header to sort by that column (numbers use the cell's data-v).
  function key(cell, numeric) {
    var raw = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent.trim();
    if (!numeric) return raw.toLowerCase();
    var v = parseFloat(raw);
    return isNaN(v) ? -Infinity : v;
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.querySelectorAll("thead th");
    heads.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var numeric = th.getAttribute("data-type") === "num";
        var desc = !th.classList.contains("sorted-desc");
        heads.forEach(function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
        th.classList.add(desc ? "sorted-desc" : "sorted-asc");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a.cells[col], numeric), y = key(b.cells[col], numeric);
          return (x < y ? -1 : x > y ? 1 : 0) * (desc ? -1 : 1);
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
