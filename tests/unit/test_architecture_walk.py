"""docs/architecture.md walks one streaming chat request hop by hop; every module and function it
names must exist, so the walk cannot go stale when code moves."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOP = re.compile(r"`((?:api|pipeline)/[\w/]+\.py)` `([\w.]+)`")


def _walk() -> str:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = doc.index("## One streaming chat request, hop by hop")
    return doc[start:doc.index("\n## ", start + 1)]


def _defined(path: Path) -> set[str]:
    """``name`` and ``Class.method`` for everything defined at module or class level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef))
    return names


def test_every_hop_of_the_walk_exists() -> None:
    hops = HOP.findall(_walk())
    assert len(hops) >= 14, hops
    missing = [f"{module} {name}" for module, name in hops
               if not (ROOT / "coordinator" / module).is_file()
               or name not in _defined(ROOT / "coordinator" / module)]
    assert not missing, f"docs/architecture.md names what the code no longer has: {missing}"
