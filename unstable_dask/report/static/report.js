// Sortable tables: click a header to sort by that column (numbers use the cell's data-v).
(function () {
  "use strict";
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
