"""The house rule for writes, checked on the source: every file ampctl writes goes through
:mod:`ampctl.files` (a fresh temp file created exclusively, never through a link, fsync, rename;
appends that refuse a link). Outside ``ampctl/files.py`` no module may write a file itself:

* ``open(...)`` / ``os.fdopen`` with a mode that writes (``w``, ``a``, ``x``, ``+``) or a mode
  that is not a literal, ``Path.open`` with a literal mode that writes; ``os.open`` with flags
  that write;
* ``.write_text(...)``, ``.write_bytes(...)``, ``.touch()`` on anything but :mod:`ampctl.files`;
* ``torch.save(obj, F)`` or ``fig.savefig(F)`` where ``F`` is not the file object of a
  ``with write_file(...) as F:``; ``shutil`` copies.

Only ``/proc/self/...`` (the kernel's own control files, written by the bench) is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ampctl"
WRITER = PKG / "files.py"
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}
_SHUTIL = {"copy", "copy2", "copyfile", "copyfileobj", "copytree", "move"}


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _mode(call: ast.Call, pos: int) -> ast.AST | None:
    for k in call.keywords:
        if k.arg == "mode":
            return k.value
    return call.args[pos] if len(call.args) > pos else None


def _writes_mode(mode: ast.AST | None) -> bool:
    if mode is None:
        return False
    text = _const_str(mode)
    return text is None or any(c in text for c in "wax+")


def _callee(call: ast.Call) -> tuple[str | None, str]:
    """``(the object's name or None, the function's name)`` of a call."""
    f = call.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        return (f.value.id if isinstance(f.value, ast.Name) else ""), f.attr
    return "", ""


def _writer_targets(tree: ast.AST) -> set[str]:
    """Names bound by ``with write_file(...) as NAME`` (or ``files.write_file``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                call = item.context_expr
                if (
                    isinstance(call, ast.Call)
                    and _callee(call)[1] == "write_file"
                    and isinstance(item.optional_vars, ast.Name)
                ):
                    names.add(item.optional_vars.id)
    return names


def _proc(call: ast.Call) -> bool:
    first = _const_str(call.args[0]) if call.args else None
    return first is not None and first.startswith("/proc/self/")


def direct_writes(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for each write that bypasses :mod:`ampctl.files` in ``source``."""
    tree = ast.parse(source)
    ok_files = _writer_targets(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        obj, name = _callee(node)
        what = None
        if name == "open" and obj in (None, "io") and _writes_mode(_mode(node, 1)):
            what = "open() that writes"
        elif name == "open" and obj not in (None, "io", "os"):
            mode = _mode(node, 0)  # a literal only: .open(step, config) is a logger's
            if _const_str(mode) is not None and _writes_mode(mode):
                what = "Path.open() that writes"
        elif name == "fdopen" and _writes_mode(_mode(node, 1)):
            what = "os.fdopen() that writes"
        elif name == "open" and obj == "os" and len(node.args) > 1:
            flags = {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if flags & _WRITE_FLAGS:
                what = "os.open() that writes"
        elif name in ("write_text", "write_bytes", "touch") and obj not in (None, "files"):
            what = f".{name}()"
        elif name == "save" and obj == "torch":
            f = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(f, ast.Name) and f.id in ok_files):
                what = "torch.save() to a path or a file not from write_file"
        elif name == "savefig":
            f = node.args[0] if node.args else None
            if not (isinstance(f, ast.Name) and f.id in ok_files):
                what = "savefig() to a path or a file not from write_file"
        elif obj == "shutil" and name in _SHUTIL:
            what = f"shutil.{name}()"
        if what is not None and not _proc(node):
            found.append((node.lineno, what))
    return found


def test_the_walk_finds_each_kind_of_planted_write():
    planted = "\n".join(
        [
            "open(p, 'w')",
            "open(p, mode='ab')",
            "open(p, m)",
            "p.open('x')",
            "os.fdopen(fd, 'wb')",
            "os.open(p, os.O_WRONLY | os.O_CREAT)",
            "p.write_text('x')",
            "p.write_bytes(b'x')",
            "p.touch()",
            "torch.save(obj, path)",
            "fig.savefig(path)",
            "shutil.copyfile(a, b)",
        ]
    )
    assert [line for line, _ in direct_writes(planted)] == list(range(1, 13))
    fine = "\n".join(
        [
            "open(p)",
            "open(p, 'rb')",
            "os.open(p, os.O_RDONLY)",
            "files.write_text(p, 'x')",
            "write_text(p, 'x')",
            "open('/proc/self/clear_refs', 'w')",
            "with write_file(p) as f:\n    torch.save(obj, f)\n    fig.savefig(f)",
        ]
    )
    assert direct_writes(fine) == []


def test_every_file_ampctl_writes_goes_through_ampctl_files():
    bad = [
        f"{p.relative_to(PKG.parent)}:{line}: {what}"
        for p in sorted(PKG.rglob("*.py"))
        if p != WRITER
        for line, what in direct_writes(p.read_text())
    ]
    assert bad == [], "write through ampctl.files instead:\n" + "\n".join(bad)
