"""The house rules, checked on the source: no import cycle between ampctl's modules, no module
over 900 lines, no function over 150, and the numeric core free of CLI, config and display code.

The import graph is read with ``ast`` (every ``import``, also inside functions and under
``TYPE_CHECKING``), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ampctl"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> the ampctl modules it imports (a package's ``__init__`` counts as the package)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for nm in names:
                while nm and nm not in mods:
                    nm = nm.rsplit(".", 1)[0] if "." in nm else ""
                if nm and nm != m and not m.startswith(nm + "."):
                    edges[m].add(nm)
    return edges


def cycles(edges: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    """Strongly connected components with more than one module that is not a package
    ``__init__`` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                real = sorted(c for c in comp if c not in packages)
                if len(real) > 1:
                    out.append(real)
    return out


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"a"}, "a.x": {"p"}}
    assert cycles(edges, set()) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}, set()) == []
    # a cycle through a package __init__ and one real module is not a cycle between modules
    assert cycles({"pkg": {"pkg.m"}, "pkg.m": {"pkg"}}, {"pkg"}) == []


def test_no_import_cycle_between_modules():
    mods = _modules()
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    assert cycles(import_graph(), packages) == []


def test_no_module_over_900_lines_and_no_function_over_150():
    big, long = [], []
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        if text.count("\n") > 900:
            big.append(f"{p.relative_to(PKG.parent)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 150:
                    long.append(f"{p.relative_to(PKG.parent)}:{node.name} ({n} lines)")
    assert big == [] and long == []


def test_the_numeric_core_imports_no_cli_config_or_display_code():
    edges = import_graph()
    core = [m for m in edges if m == "ampctl.amp" or m.startswith("ampctl.amp.")]
    outside = {
        (m, dep)
        for m in core
        for dep in edges[m]
        if not (dep == "ampctl.amp" or dep.startswith("ampctl.amp.") or dep == "ampctl.errors")
    }
    assert outside == set()
    for m in core:
        tree = ast.parse(_modules()[m].read_text())
        third = {
            (a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom) and not getattr(n, "level", 0)
            for a in (n.names if isinstance(n, ast.Import) else [n])
        }
        assert not third & {"typer", "rich", "hydra", "omegaconf"}, m
