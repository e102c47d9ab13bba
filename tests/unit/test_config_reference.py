"""The generated configuration reference: in step with the model, complete, and right where it matters."""

from __future__ import annotations

import difflib
import enum
import json
import re
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

import deploy.config_reference as ref
from coordinator.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
NOTES = ROOT / "docs" / "configuration.notes.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults must be the model's, not whatever COORD_* variables the test run inherited."""
    import os

    for name in [n for n in os.environ if n.upper().startswith("COORD_")]:
        monkeypatch.delenv(name)


def _page() -> str:
    return ref.render(Settings, ref.parse_notes(NOTES.read_text(encoding="utf-8")))


def _rows() -> dict[str, ref.Row]:
    return {r.key: r for top in ref.build_sections(Settings) for s in top.walk() for r in s.rows}


def _yaml_blocks(page: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", page, flags=re.S | re.M)


def test_committed_page_matches_the_model() -> None:
    """The drift test: a key, default, description or note changed without regenerating the page."""
    page, committed = _page(), DOC.read_text(encoding="utf-8")
    diff = "\n".join(list(difflib.unified_diff(committed.splitlines(), page.splitlines(), "committed",
                                               "generated", lineterm="", n=1))[:40])
    assert committed == page, f"docs/configuration.md is stale: run `make config-doc`\n{diff}"


def test_a_key_without_description_fails_the_generator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    class Entry(BaseModel):  # no docstring: its list section would have no introduction
        name: str = Field(description="documented")

    class Inner(BaseModel):
        """A section."""

        documented: int = Field(default=1, description="has one")
        bare: int = 2

    class Tiny(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="T_", env_nested_delimiter="__")
        inner: Inner = Field(default_factory=Inner)
        entries: list[Entry] = Field(default_factory=list, description="documented list")

    with pytest.raises(ref.MissingDescriptionError) as caught:
        ref.build_sections(Tiny)
    assert caught.value.keys == ["inner.bare", "entries[] (class Entry has no docstring)"]

    monkeypatch.setattr(ref, "Settings", Tiny)  # the command line refuses too, naming the keys
    assert ref.main(["--check", str(tmp_path / "page.md"), "--notes", str(NOTES)]) == 2
    assert "inner.bare" in capsys.readouterr().err


def test_rows_show_type_default_and_environment() -> None:
    rows = _rows()
    drain = rows["server.drain_delay_s"]
    assert (drain.type, drain.default, drain.env) == ("float ≥ 0", "`5.0`", "`COORD_SERVER__DRAIN_DELAY_S`")
    assert drain.description.startswith("after SIGTERM, /ready answers 503")
    assert ("| `server.drain_delay_s` | `float ≥ 0` | `5.0` | `COORD_SERVER__DRAIN_DELAY_S` | after SIGTERM"
            in DOC.read_text(encoding="utf-8"))
    assert rows["server.request_mode"].type == '"strict" | "compat"'
    assert rows["limits.default_max_tokens"].type == "int ≥ 1 | null"
    assert rows["limits.request_id_max_length"].type == "8 ≤ int ≤ 512"
    assert rows["render.urls"].env == "`COORD_RENDER__URLS` (JSON)"
    assert rows["scheduling.prefix.source"].env == "`COORD_SCHEDULING__PREFIX__SOURCE`"
    assert rows["engines"].env == "`COORD_ENGINES` (JSON)"
    assert (rows["engines[].url"].default, rows["engines[].url"].env) == ("required", ref.NO_ENV)
    assert rows["models"].default == ("`[{name: smollm2-135m-instruct, aliases: [gpt-4o-mini], max_model_len: "
                                      "null, vocab_size: null, path: null, tokenizer_path: null, adapters: []}]`")


def test_every_environment_name_reaches_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variable of the environment column, set to another value, changes its key (or is refused
    by that key's validation): a wrong name would be ignored silently."""
    rows = [r for r in _rows().values() if r.env != ref.NO_ENV]
    assert len(rows) > 50
    defaults = Settings().model_dump(mode="json")
    for row in rows:
        name, key = row.env.split("`")[1], row.key.split(".")
        value = _other_value(_get(defaults, key), row.type)
        monkeypatch.setenv(name, value if isinstance(value, str) else json.dumps(value))
        try:
            assert _get(Settings().model_dump(mode="json"), key) != _get(defaults, key), f"{name} ignored"
        except ValidationError as exc:
            locs = [[str(p) for p in e["loc"]][:len(key)] for e in exc.errors()]
            assert all(loc and key[:len(loc)] == loc for loc in locs), (name, locs)  # its key or section
        monkeypatch.delenv(name)


def _get(tree: Any, key: list[str]) -> Any:
    for part in key:
        tree = tree[part]
    return tree


def _other_value(default: Any, type_: str) -> Any:
    """A value unlike ``default`` of the key's shape (bounds may still refuse it: that is fine too)."""
    if isinstance(default, bool):
        return "false" if default else "true"
    if isinstance(default, int | float):
        return str(default - 1 if "≤" in type_ else default + 1)
    if isinstance(default, str) and type_.startswith('"'):
        return next(o for o in json.loads("[" + type_.replace(" | ", ",") + "]") if o != default)
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, list):
        return [] if default else ["http://127.0.0.1:9999"]
    if isinstance(default, dict):
        return {} if default else {"x": 1}
    return "1" if type_.startswith(("int", "float")) else "x"  # a null default


def test_defaults_yaml_round_trips_and_covers_every_key(tmp_path: Path) -> None:
    page = _page()
    example = _yaml_blocks(page.split("## All defaults as YAML", 1)[1])[0]
    path = tmp_path / "defaults.yaml"
    path.write_text(example, encoding="utf-8")
    assert load_settings(path).model_dump(mode="json") == Settings().model_dump(mode="json")

    rows = _rows()
    sections = {s.path for top in ref.build_sections(Settings) for s in top.walk()}
    mentioned = set(_paths(yaml.safe_load(example), "", set(rows)))
    assert mentioned <= set(rows) | sections, f"undocumented keys in the example: {mentioned - set(rows)}"
    empty_lists = {k for k, r in rows.items() if r.default == "`[]`"}
    missing = {k for k in set(rows) - mentioned if not any(k.startswith(f"{e}[].") for e in empty_lists)}
    assert not missing, f"keys missing from the YAML example: {sorted(missing)}"


def _paths(value: Any, path: str, rows: set[str]) -> list[str]:
    """Every key path in a YAML tree; a row's own value (a mapping default) is not walked into."""
    out: list[str] = []
    if isinstance(value, dict) and (path == "" or path not in rows):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            out += [sub, *_paths(v, sub, rows)]
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                out += _paths(item, f"{path}[]", rows)
    return out


def test_every_yaml_example_on_the_page_is_a_valid_config(tmp_path: Path) -> None:
    """The hand-written examples in the notes are checked against the model too."""
    blocks = _yaml_blocks(_page())
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        path = tmp_path / f"example{i}.yaml"
        path.write_text(block, encoding="utf-8")
        load_settings(path)


def test_notes_must_name_a_section() -> None:
    with pytest.raises(ValueError, match="name no section: renderr"):
        ref.render(Settings, {"renderr": "typo"})
    notes = ref.parse_notes("preface\n<!-- notes: intro -->\nHello.\n<!-- notes: scheduling.prefix -->\nIndex.\n")
    assert notes == {"intro": "Hello.", "scheduling.prefix": "Index."}
    page = ref.render(Settings, notes)
    assert page.index("Hello.") < page.index("## server")
    assert page.index("### scheduling.prefix") < page.index("Index.") < page.index("## topology")


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_type_names_for_any_pydantic_field() -> None:
    class Sub(BaseModel):
        """Sub."""

        x: int = Field(default=0, description="x")

    class Odd(BaseModel):
        """Odd shapes a later key may have."""

        secrets: list[SecretStr] = Field(default_factory=list, description="d")
        table: dict[str, Any] = Field(default_factory=dict, description="d")
        pair: tuple[int, str] = Field(default=(1, "a"), description="d")
        colour: Colour = Field(default=Colour.RED, description="d")
        maybe: Literal["a", "b"] | None = Field(default=None, description="d")
        path: Path = Field(default=Path("models"), description="d")
        either: int | str = Field(default=3, description="d")
        ratio: float = Field(default=0.5, gt=0, lt=1, description="d")
        name: str = Field(default="n", min_length=1, description="d")
        sub: Sub | None = Field(default=None, description="an optional object")
        pools: dict[str, Sub] = Field(default_factory=dict, description="named entries")

    class Root(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="R_", env_nested_delimiter="__")
        level: int = Field(default=1, description="a key at the top")
        odd: Odd = Field(default_factory=Odd)

    sections = ref.build_sections(Root)
    rows = {r.key: r for top in sections for s in top.walk() for r in s.rows}
    assert {k: r.type for k, r in rows.items()} == {
        "odd.secrets": "list[secret]", "odd.table": "map[str, any]", "odd.pair": "[int, str]",
        "odd.colour": '"red" | "blue"', "odd.maybe": '"a" | "b" | null', "odd.path": "path",
        "odd.either": "int | str", "odd.ratio": "0 < float < 1", "odd.name": "str length ≥ 1",
        "odd.sub": "object | null", "odd.sub.x": "int", "odd.pools": "map[str, object]",
        "odd.pools.<name>.x": "int", "level": "int",
    }
    assert [s.path for s in sections] == ["", "odd"]  # top-level scalars first, under "Top-level keys"
    assert rows["level"].env == "`R_LEVEL`"
    assert rows["odd.pair"].default == "`[1, a]`"
    assert rows["odd.colour"].default == "`red`"
    assert rows["odd.sub"].env == "`R_ODD__SUB` (JSON)"
    assert rows["odd.sub.x"].env == ref.NO_ENV


def test_operations_doc_lists_every_metric() -> None:
    """docs/operations.md's metric table is hand-kept: a collector added without a row fails here."""
    source = "".join((ROOT / "coordinator" / path).read_text(encoding="utf-8")
                     for path in ("observability/metrics.py", "runtime/pod.py", "runtime/workers.py"))  # the pod's own series too
    exposed = {name + ("_total" if kind == "Counter" else "")
               for kind, name in re.findall(r'(Counter|Gauge|Histogram|Metric)\(\s*"(coordinator_\w+)"', source)}
    assert len(exposed) > 20
    documented = set(re.findall(r"coordinator_\w+", (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")))
    assert not exposed - documented, f"add to docs/operations.md, 'All metrics': {sorted(exposed - documented)}"
    assert not documented - exposed, f"docs/operations.md names metrics that do not exist: {documented - exposed}"
