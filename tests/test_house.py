"""The house rules, checked on the source: no import cycle between ampctl's modules, no module
over 900 lines, no function over 150, and the numeric core free of CLI, config and display code.

The import graph is read with ``ast`` (every ``import``, also inside functions and under
``TYPE_CHECKING``), so a lazy import cannot hide a cycle; a module that imports from its own
package's ``__init__`` depends on it, and the packages' modules taken together must not import one
another in a cycle either.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ampctl"


def _modules(root: Path = PKG) -> dict[str, Path]:
    mods = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (a package's ``__init__`` counts as
    the package). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else
    to ``pkg``: a module that takes names from its own package's ``__init__`` depends on it."""
    mods = _modules(root)
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
                names = [base + "." + a.name for a in node.names]
                names = [nm if nm in mods else base for nm in names]
            for nm in names:
                while nm and nm not in mods:
                    nm = nm.rsplit(".", 1)[0] if "." in nm else ""
                if nm and nm != m:
                    edges[m].add(nm)
    return edges


def pass_through(mods: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` only imports (and names ``__all__``): a cycle through one
    of them and a single module is not a cycle between modules. An ``__init__`` with code of its
    own (a function, a class, a constant) is a module like any other."""

    def only_imports(s: ast.stmt) -> bool:
        doc = isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
        names = [getattr(t, "id", "") for t in getattr(s, "targets", [])]
        return isinstance(s, ast.Import | ast.ImportFrom) or doc or names == ["__all__"]

    return {
        m
        for m, p in mods.items()
        if p.name == "__init__.py" and all(map(only_imports, ast.parse(p.read_text()).body))
    }


def package_edges(edges: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The import graph between ``package``'s children, each child (a module, or a subpackage's
    modules taken together) one node."""

    def child(m: str) -> str | None:
        rest = m.removeprefix(package + ".")
        return None if rest == m else f"{package}.{rest.split('.')[0]}"

    out: dict[str, set[str]] = {}
    for m, deps in edges.items():
        if (c := child(m)) is not None:
            out.setdefault(c, set()).update(d for d in map(child, deps) if d not in (None, c))
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


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
    # ... unless the __init__ has code of its own
    assert cycles({"pkg": {"pkg.m"}, "pkg.m": {"pkg"}}, set()) == [["pkg", "pkg.m"]]


def test_a_lazy_import_of_a_child_that_imports_its_package_is_a_cycle(tmp_path):
    pkg = tmp_path / "top" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text('"""Only imports."""\nfrom .pkg import a\n')
    (pkg / "__init__.py").write_text(
        "class Base: ...\n\ndef make():\n    from .a import A\n\n    return A()\n"
    )
    (pkg / "a.py").write_text("from . import Base\n\nclass A(Base): ...\n")
    (pkg / "b.py").write_text("from . import a\nfrom .a import A\n")
    edges = import_graph(tmp_path / "top")
    # a submodule taken by name from its package is an edge to the submodule, not the package
    assert edges["top.pkg.b"] == {"top.pkg.a"}
    assert edges["top.pkg.a"] == {"top.pkg"} and edges["top.pkg"] == {"top.pkg.a"}
    mods = _modules(tmp_path / "top")
    assert pass_through(mods) == {"top"}
    assert cycles(edges, pass_through(mods)) == [["top.pkg", "top.pkg.a"]]
    # with the base class in its own module the package only chooses: no cycle
    (pkg / "__init__.py").write_text(
        "from .base import Base\n\ndef make():\n    from .a import A\n"
    )
    (pkg / "base.py").write_text("class Base: ...\n")
    (pkg / "a.py").write_text("from .base import Base\n\nclass A(Base): ...\n")
    assert cycles(import_graph(tmp_path / "top"), pass_through(mods)) == []


def test_the_package_graph_finds_a_planted_cycle_between_packages():
    # no two modules import each other, but r.p and r.q do, their modules taken together
    edges = {"r.p.a": {"r.q.b"}, "r.q.b": set(), "r.q.c": {"r.p.d"}, "r.p.d": set(), "r.s": set()}
    assert cycles(edges, set()) == []
    assert package_edges(edges, "r") == {"r.p": {"r.q"}, "r.q": {"r.p"}, "r.s": set()}
    assert cycles(package_edges(edges, "r"), set()) == [["r.p", "r.q"]]
    assert package_edges(edges, "r.p") == {"r.p.a": set(), "r.p.d": set()}


def test_no_import_cycle_between_modules():
    assert cycles(import_graph(), pass_through(_modules())) == []


def test_no_import_cycle_between_packages():
    """At every level, a package's children (modules, subpackages taken together) import one
    another one way only: e.g. ``ampctl.config`` composes ``ampctl.train``'s settings, so nothing
    in ``ampctl.train`` imports ``ampctl.config``."""
    edges = import_graph()
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    found = {pkg: cycles(package_edges(edges, pkg), set()) for pkg in sorted(packages)}
    assert {pkg: c for pkg, c in found.items() if c} == {}


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
