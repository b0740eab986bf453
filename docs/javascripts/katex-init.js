// Renders the mathematics of the docs with the vendored KaTeX (docs/vendor/katex),
// so the site needs no network. pymdownx.arithmatex (generic mode) leaves each
// formula as \(...\) or \[...\] text inside an element of class "arithmatex";
// only those elements are rendered, so "$" or "\(" in prose and code stay as written.
(function () {
  "use strict";

  function renderMath(root) {
    var nodes = root.querySelectorAll(".arithmatex");
    for (var i = 0; i < nodes.length; i++) {
      var node = nodes[i];
      var text = node.textContent.trim();
      var display = text.indexOf("\\[") === 0;
      var inline = text.indexOf("\\(") === 0;
      if (!display && !inline) continue;
      var tex = text.slice(2, -2);
      try {
        // throwOnError: a formula KaTeX cannot parse is a console error (the docs
        // test fails on it), not silently red text.
        katex.render(tex, node, { displayMode: display, throwOnError: true });
      } catch (err) {
        console.error("KaTeX could not render " + JSON.stringify(tex) + ": " + err.message);
      }
    }
  }

  if (window.document$ && typeof window.document$.subscribe === "function") {
    // Material for MkDocs: runs on the first load and after each instant navigation.
    window.document$.subscribe(function () { renderMath(document.body); });
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { renderMath(document.body); });
  } else {
    renderMath(document.body);
  }
})();
