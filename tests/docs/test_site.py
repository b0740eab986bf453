"""The built docs site in a real browser (headless Chromium), offline.

The site is built with ``mkdocs build --strict`` into a temporary folder and
served on 127.0.0.1. Each page is loaded with ``chromium --headless --dump-dom``
with every host but 127.0.0.1 unresolvable, so anything fetched from a CDN fails.
A script injected at the top of each page records console errors, uncaught
exceptions and failed resource loads into an attribute of ``<html>``, which the
dumped DOM carries back; the server records every request it could not serve.

Checks: the method page's mathematics is rendered by KaTeX (``.katex`` elements,
one per formula, and no ``\\(`` / ``\\[`` delimiters left in its text), and every
page loads without a console error, an uncaught exception or a failed request.

Needs Debian's ``chromium`` (``apt-get install chromium``; ``scripts/_venv.sh``
installs it). Skipped when it is missing, unless ``NORMFLAT_REQUIRE_BACKENDS=1``
(CI), where it fails instead.
"""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")

# Runs before any other script of the page: records what a console would show as an error.
PROBE = """<script>(function () {
  var errors = [], root = document.documentElement;
  function record(message) { errors.push(String(message)); root.setAttribute("data-normflat-errors", JSON.stringify(errors)); }
  root.setAttribute("data-normflat-errors", "[]");
  var original = console.error;
  console.error = function () {
    record("console.error: " + Array.prototype.map.call(arguments, String).join(" "));
    return original.apply(console, arguments);
  };
  window.addEventListener("error", function (event) {
    var target = event.target;
    if (target && target !== window && (target.src || target.href)) record("failed to load " + (target.src || target.href));
    else record("uncaught: " + event.message);
  }, true);
  window.addEventListener("unhandledrejection", function (event) { record("unhandled rejection: " + event.reason); });
})();</script>"""


def _browser() -> str:
    found = os.environ.get("NORMFLAT_CHROMIUM") or next(filter(None, map(shutil.which, BROWSERS)), None)
    if found is None:
        if os.environ.get("NORMFLAT_REQUIRE_BACKENDS") == "1":
            pytest.fail("chromium is required in CI (NORMFLAT_REQUIRE_BACKENDS=1) to test the docs site; "
                        "install it with `apt-get install chromium` (scripts/_venv.sh does).")
        pytest.skip("chromium not installed (apt-get install chromium)")
    return found


class _Handler(SimpleHTTPRequestHandler):
    failures: list[str]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix == ".html" and path.is_file():
            body = path.read_bytes().replace(b"<head>", b"<head>" + PROBE.encode(), 1)
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_request(self, code="-", size="-") -> None:
        if str(code) not in ("200", "304"):
            self.failures.append(f"{self.path} -> {code}")

    def log_message(self, format, *args) -> None:  # keep the test output quiet
        pass


class _Page(html.parser.HTMLParser):
    """Text (without scripts, styles, code and KaTeX's TeX annotations), class counts,
    the recorded errors and the external scripts and stylesheets of a dumped page."""

    SKIP = {"script", "style", "code", "pre", "annotation"}

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.classes: dict[str, int] = {}
        self.errors: list[str] | None = None
        self.resources: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in (attrs.get("class") or "").split():
            self.classes[name] = self.classes.get(name, 0) + 1
        if tag == "html" and "data-normflat-errors" in attrs:
            self.errors = json.loads(attrs["data-normflat-errors"])
        if tag == "script" and attrs.get("src"):
            self.resources.append(attrs["src"])
        if tag == "link" and attrs.get("rel") == "stylesheet":
            self.resources.append(attrs.get("href") or "")
        if tag in self.SKIP:
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    browser = _browser()
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert build.returncode == 0, build.stdout + build.stderr
    failures: list[str] = []
    handler = type("Handler", (_Handler,), {"failures": failures})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"dir": out, "url": f"http://127.0.0.1:{server.server_address[1]}", "browser": browser,
               "failures": failures, "profiles": tmp_path_factory.mktemp("profiles")}
    finally:
        server.shutdown()
        server.server_close()


def _load(site, page: str) -> tuple[_Page, str]:
    """The page's DOM after its scripts ran, parsed; and chromium's stderr."""
    profile = site["profiles"] / page.strip("/").replace("/", "_") or "index"
    cmd = [site["browser"], "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
           # Offline: any host but this machine's loopback fails to resolve (no CDN can serve a file).
           "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
           "--virtual-time-budget=10000", "--dump-dom", f"{site['url']}/{page}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    parsed = _Page()
    parsed.feed(proc.stdout)
    return parsed, proc.stderr


def _pages(site_dir: Path) -> list[str]:
    """Every page's URL path relative to the site root ("" for the home page)."""
    return sorted("" if p.parent == site_dir else p.parent.relative_to(site_dir).as_posix() + "/"
                  for p in site_dir.rglob("index.html"))


def test_method_page_math_is_rendered(site):
    page, _ = _load(site, "method/")
    text = "".join(page.text)
    assert "Normalized Flat Minima" in text  # the page itself loaded
    formulas = page.classes.get("arithmatex", 0)
    assert formulas > 50, formulas  # the method page is mostly mathematics
    # One .katex per formula: every formula was rendered, none left as TeX.
    assert page.classes.get("katex", 0) == formulas, (page.classes.get("katex"), formulas)
    assert page.classes.get("katex-display", 0) > 0  # display equations too
    for delimiter in ("\\(", "\\)", "\\[", "\\]", "$$"):
        assert delimiter not in text, f"raw TeX {delimiter!r} left on the method page"
    assert page.errors == [], page.errors


def test_every_page_loads_without_errors(site):
    pages = _pages(site["dir"])
    assert len(pages) >= 10 and "method/" in pages and "" in pages
    with ThreadPoolExecutor(max_workers=2) as pool:
        loaded = dict(zip(pages, pool.map(partial(_load, site), pages)))
    problems = []
    for name, (page, stderr) in loaded.items():
        if page.errors is None:
            problems.append(f"/{name}: the probe did not run")
        problems += [f"/{name}: {e}" for e in page.errors or []]
        problems += [f"/{name}: uncaught exception in chromium's log: {line}" for line in stderr.splitlines()
                     if ":CONSOLE" in line and "Uncaught" in line]
        problems += [f"/{name}: loads {r} from another host" for r in page.resources
                     if r.startswith(("http:", "https:", "//"))]
        if page.classes.get("arithmatex", 0) != page.classes.get("katex", 0):
            problems.append(f"/{name}: {page.classes.get('arithmatex', 0)} formulas but "
                            f"{page.classes.get('katex', 0)} rendered")
    problems += [f"server: {f}" for f in site["failures"]]
    assert not problems, "\n".join(problems)
