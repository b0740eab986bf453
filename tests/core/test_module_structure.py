"""Module-level import structure: no cycle between the report and its figures.

``Report.plot`` imports :mod:`normflat.plotting` inside the method; the figures
module must not import :mod:`normflat.core.report` (nor the study) when it loads,
or the two would form an import cycle. The graph is read from the source with
``ast`` (only imports that run when a module loads: module and class bodies,
not function bodies nor ``if TYPE_CHECKING:`` blocks).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import normflat

PACKAGE_DIR = Path(normflat.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _load_time_imports(tree: ast.Module):
    """Import nodes that execute when the module is imported."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))


def import_graph() -> dict[str, set[str]]:
    """``{module: normflat modules it imports at load time}`` for every module of the package."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _load_time_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_the_graph_sees_known_imports():
    # Guard against a checker that finds nothing: these imports exist.
    graph = import_graph()
    assert "normflat.core.report" in graph["normflat.core.measures"]
    assert "normflat.core.constants" in graph["normflat.plotting"]
    assert "normflat.plotting" in graph["normflat.study.figures"]
    # ... and Report.plot's import of the figures is inside a method, so not a load-time edge.
    assert "normflat.plotting" not in graph["normflat.core.report"]


def test_no_import_cycle_between_report_and_plotting():
    graph = import_graph()
    assert "normflat.core.report" not in graph["normflat.plotting"]
    assert "normflat.plotting" not in reachable(graph, "normflat.core.report")
    for module in ("normflat.core.report", "normflat.plotting", "normflat.core.constants"):
        assert module not in reachable(graph, module), f"{module} is on an import cycle"


def test_plotting_does_not_reach_the_study():
    graph = import_graph()
    assert not any(m.startswith("normflat.study") for m in reachable(graph, "normflat.plotting"))


def test_importing_plotting_imports_neither_the_study_nor_matplotlib():
    code = textwrap.dedent(
        """
        import sys
        import normflat.plotting
        print(sorted(m for m in sys.modules if m.startswith("normflat.study") or m.split(".")[0] == "matplotlib"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
