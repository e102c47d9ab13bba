"""The house's layering, checked on the source (docs/architecture.md, "Layers"): the coordinator
runs on a small CPU image without vLLM, its pipeline knows nothing of HTTP, and its imports go down.

Every coordinator module belongs to one layer; a module may import its own layer and the ones below,
never one above (an import inside a function or under ``TYPE_CHECKING`` counts too: it is the same
dependency, only paid later). No two modules may import each other, directly or around a loop. The
deployables beside the coordinator (the render sidecar, the token engine) are checked for what they
import from it.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom first. A module's layer is the one of the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contracts", ("coordinator.contracts",)),
    ("config", ("coordinator.config",)),
    ("observability", ("coordinator.observability",)),
    ("vocabulary", ("coordinator.pipeline.errors", "coordinator.pipeline.context",
                    "coordinator.pipeline.structured", "coordinator.pipeline.token_ids",
                    "coordinator.pipeline.vocabulary", "coordinator.pipeline.http_lanes",
                    "coordinator.pipeline.obfuscation")),
    ("clients", ("coordinator.pipeline.sidecar", "coordinator.pipeline.engines")),
    ("scheduling", ("coordinator.pipeline.scheduling",)),
    ("admission", ("coordinator.pipeline.admission",)),
    ("conversions", ("coordinator.pipeline.catalog", "coordinator.pipeline.local_tokenizer",
                     "coordinator.pipeline.chat_form", "coordinator.pipeline.messages",
                     "coordinator.pipeline.responses", "coordinator.pipeline.validation",
                     "coordinator.pipeline.media",
                     "coordinator.pipeline.derender")),
    ("topology", ("coordinator.pipeline.topology", "coordinator.pipeline.native_route")),
    ("stages", ("coordinator.pipeline.render", "coordinator.pipeline.native_api",
                "coordinator.pipeline.prompt_echo")),
    ("service", ("coordinator.pipeline.service",)),
    ("protocols", ("coordinator.nnrp",)),
    ("doors", ("coordinator.api",)),
    ("app", ("coordinator.app",)),
    ("runtime", ("coordinator.runtime", "coordinator.indexer", "coordinator.embedded", "coordinator.__main__")),
    ("tools", ("coordinator.nnrp.conformance",)),
]


def imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_coordinator_never_imports_vllm_or_torch() -> None:
    """The coordinator runs on a small CPU image without vLLM."""
    mods = imported_after("import coordinator.app, coordinator.__main__")
    assert not {m for m in mods if m == "vllm" or m.startswith(("vllm.", "torch"))}


def test_pipeline_is_http_framework_free() -> None:
    mods = imported_after("import coordinator.pipeline.service")
    assert not {m for m in mods if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}


def test_simulator_loads_nothing_of_the_coordinator_but_its_contracts() -> None:
    """The simulator stands in for vLLM: it must not lean on the code it tests, nor on vLLM."""
    mods = imported_after("import token_engine.simulator, token_engine.simulator.app")
    assert "coordinator.contracts.kv_events" in mods  # it publishes the contract's structs
    assert not {m for m in mods if m.startswith("vllm")
                or (m.startswith("coordinator.") and not m.startswith("coordinator.contracts"))}


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@cache
def _known() -> frozenset[str]:
    return frozenset(m for package in ("coordinator", "render_sidecar", "token_engine") for m in _modules(package))


@cache
def _imports(path: Path) -> frozenset[str]:
    """Every absolute module name imported anywhere in the file. ``from a import b`` is an import of
    the module ``a.b`` when there is one (importing a submodule by name), else of ``a``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in _known() else node.module)
    return frozenset(names)


def _layer(module: str) -> int:
    best, rank = -1, -1
    for index, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def _graph() -> dict[str, set[str]]:
    modules = _modules("coordinator")
    return {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}


# Folders whose modules sit in several layers: their ``__init__`` must import nothing.
CONTAINERS = ("coordinator", "coordinator.pipeline")


def test_every_coordinator_module_has_a_layer() -> None:
    orphans = sorted(m for m in _graph() if m not in CONTAINERS and _layer(m) < 0)
    assert not orphans, f"give these a layer in LAYERS (and docs/architecture.md): {orphans}"
    graph = _graph()
    assert not {c: graph[c] for c in CONTAINERS if graph[c]}, "a container package imports something"


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = sorted(f"{m} ({LAYERS[_layer(m)][0]}) -> {n} ({LAYERS[_layer(n)][0]})"
                    for m, deps in _graph().items() if m not in CONTAINERS
                    for n in deps if _layer(n) > _layer(m))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    """Two modules importing each other, or a longer loop (a -> b -> c -> a): the same knot."""
    try:
        list(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"import cycle in coordinator/: {' -> '.join(err.args[1])}") from None


@pytest.mark.parametrize("package", ["render_sidecar", "token_engine"])
def test_deployables_import_only_the_contracts(package: str) -> None:
    """The render sidecar and the token engine ship in their own images: from the coordinator's tree
    they take only ``coordinator.contracts`` (the rules both sides of a wire share), which the render
    image copies alone."""
    used = {n for p in _modules(package).values() for n in _imports(p) if n.split(".")[0] == "coordinator"}
    assert used, f"{package} shares no contract: the check below would hold for nothing"
    outside = sorted(n for n in used if n != "coordinator.contracts" and not n.startswith("coordinator.contracts."))
    assert not outside, f"{package} imports {outside} from the coordinator"


def test_contracts_import_nothing_else_of_the_coordinator() -> None:
    """The bottom of the house: standard library, msgspec and NumPy only (the block hashes' cumsum),
    so any image can carry it: the render and engine images have NumPy with vLLM."""
    for name, path in _modules("coordinator").items():
        if name == "coordinator.contracts" or name.startswith("coordinator.contracts."):
            roots = {n.split(".")[0] for n in _imports(path)}
            deps = {n for n in _imports(path) if n.split(".")[0] == "coordinator"
                    and not n.startswith("coordinator.contracts")}
            assert not deps, f"{name} imports {sorted(deps)}"
            third = roots - set(sys.stdlib_module_names) - {"coordinator", "msgspec", "numpy", "__future__"}
            assert not third, f"{name} needs {sorted(third)}"


def test_scheduling_plugins_see_engines_only_through_their_view() -> None:
    """Filters, scorers and pickers are typed against ``scheduling/types.py``'s read-only
    ``EngineView``: none of them may reach for the registry or its ``Engine`` (and what it could change)."""
    plugins = ROOT / "coordinator" / "pipeline" / "scheduling"
    for name in ("types", "filters", "scorers", "pickers"):
        deps = _imports(plugins / f"{name}.py")
        reached = deps & {"coordinator.pipeline.engines.registry", "coordinator.pipeline.engines.engine"}
        assert not reached, f"scheduling/{name}.py imports {sorted(reached)}"


# What a door may take from the pipeline: the request runner and the request's vocabulary, the
# tenant a key names, the model list, and the conversions of other APIs. The operator doors also
# reach what they operate (admin: admission and the engine pool; the metaserver: trigger callbacks).
DOOR_FACES = ("coordinator.pipeline.service", "coordinator.pipeline.context", "coordinator.pipeline.errors",
              "coordinator.pipeline.admission.tenants", "coordinator.pipeline.catalog",
              "coordinator.pipeline.chat_form", "coordinator.pipeline.messages", "coordinator.pipeline.responses")
OPERATOR_FACES = {
    "coordinator.api.admin": ("coordinator.pipeline.admission.controller", "coordinator.pipeline.engines.registry",
                              "coordinator.pipeline.engines.engine", "coordinator.pipeline.engines.lora"),
    "coordinator.api.admin_lora": ("coordinator.pipeline.engines.registry", "coordinator.pipeline.engines.engine",
                                   "coordinator.pipeline.engines.lora", "coordinator.pipeline.engines.adapters"),
    "coordinator.api.metaserver": ("coordinator.pipeline.topology.trigger",),
}


def test_doors_reach_the_pipeline_only_through_its_faces() -> None:
    def allowed(door: str, target: str) -> bool:
        faces = DOOR_FACES + OPERATOR_FACES.get(door, ())
        return any(target == f or target.startswith(f + ".") for f in faces)

    beyond = sorted(f"{m} -> {n}" for m, deps in _graph().items()
                    if m.startswith(("coordinator.api", "coordinator.nnrp"))
                    for n in deps if n.startswith("coordinator.pipeline.") and not allowed(m, n))
    assert not beyond, "doors reaching past the pipeline's faces:\n" + "\n".join(beyond)


COMPOSITION_ROOT = "coordinator.app"  # wires every concrete part, so it may reach any room


def _face(package: str) -> set[str] | None:
    """The names a package's ``__init__.py`` declares public (``__all__``), None when it declares none."""
    path = ROOT / Path(*package.split(".")) / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def test_every_subpackage_declares_its_face() -> None:
    packages = sorted({m for m, p in _modules("coordinator").items() if p.name == "__init__.py"} - {"coordinator"})
    bare = [p for p in packages if _face(p) is None]
    assert not bare, f"subpackages without __all__: {bare}"


def test_other_packages_reach_a_package_only_through_its_face() -> None:
    """A module outside a subpackage may import the package itself or a module its ``__all__`` names,
    never one of its rooms; a new room stays private until the package says otherwise."""
    modules = _modules("coordinator")
    packages = {m for m, p in modules.items() if p.name == "__init__.py"} - {"coordinator"}
    beyond = []
    for importer, deps in _graph().items():
        if importer == COMPOSITION_ROOT:
            continue
        for dep in deps:
            for package in packages:
                inside = dep.startswith(package + ".") and not importer.startswith(package + ".") \
                    and importer != package
                if inside and dep.count(".") == package.count(".") + 1:
                    face = _face(package) or set()
                    if dep.rsplit(".", 1)[1] not in face:
                        beyond.append(f"{importer} -> {dep}")
    assert not beyond, "imports past a package's face:\n" + "\n".join(sorted(beyond))


def test_a_long_module_says_why_it_is_one_job() -> None:
    """A module past 500 lines is usually two jobs; one that is not says so (and why) in its docstring,
    so a reviewer can argue with the reason instead of guessing it."""
    unexplained = []
    for name, path in _modules("coordinator").items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "one job" not in doc.lower() and "one file on purpose" not in doc.lower():
                unexplained.append(f"{name} ({text.count(chr(10))} lines)")
    assert not unexplained, f"long modules without a reason: {unexplained}"


def test_the_runner_is_the_lifecycle_only() -> None:
    """``service.py`` runs a request's life; what each stage does lives in the stage (derender's
    fix-ups, the tenant gate, the race with a leaving client), so the runner stays readable whole."""
    lines = (ROOT / "coordinator" / "pipeline" / "service.py").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"service.py has {lines} lines: move the stage work out to its stage"
