"""The coordinator runs on a small CPU image without vLLM, and its pipeline knows nothing of HTTP."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_coordinator_never_imports_vllm_or_torch() -> None:
    mods = imported_after("import coordinator.app, coordinator.__main__")
    assert not {m for m in mods if m == "vllm" or m.startswith(("vllm.", "torch"))}


def test_pipeline_is_http_framework_free() -> None:
    mods = imported_after("import coordinator.pipeline.service")
    assert not {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}


def test_simulator_imports_nothing_from_the_coordinator() -> None:
    mods = imported_after("import token_engine.simulator, token_engine.simulator.app")
    assert not {m for m in mods if m == "coordinator" or m.startswith(("coordinator.", "vllm"))}


def _coordinator_imports() -> dict[str, set[str]]:
    """Every coordinator module → the coordinator modules it imports (TYPE_CHECKING imports too)."""
    import ast

    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "coordinator").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def test_no_two_coordinator_modules_import_each_other() -> None:
    graph = _coordinator_imports()
    mutual = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert not mutual, f"modules that import each other (give them a seam both use): {mutual}"


def test_coordinator_imports_have_no_cycle_of_any_length() -> None:
    """A longer loop (a → b → c → a) is the same knot as a mutual import, only harder to see."""
    import graphlib

    try:
        list(graphlib.TopologicalSorter(_coordinator_imports()).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle in coordinator/: {' -> '.join(err.args[1])}") from None
