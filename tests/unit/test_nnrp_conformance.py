"""Conformance recipes without a server: loading, ``${MODEL_ID}``, §10.3 selection, event matching."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.nnrp.conformance.recipes import (
    Observed,
    RecipeError,
    judge,
    load_recipes,
    match_events,
    match_value,
    parse_recipe,
    why_not_selected,
)
from coordinator.nnrp.conformance.runner import Outcome, envelope_of, exit_code, http_base, print_table
from coordinator.nnrp.profile import (
    Extension,
    ExtensionSelection,
    ServingCapabilities,
    build_manifest,
    parse_manifest,
)

LEVEL1 = build_manifest(ServingCapabilities(tool_calls=True))


def by_case() -> dict[int, Any]:
    return {r.case: r for r in load_recipes()}


def test_ten_level1_recipes_are_packaged_one_per_case() -> None:
    recipes = load_recipes()
    assert sorted(r.case for r in recipes) == list(range(1, 11))
    assert len({r.id for r in recipes}) == 10
    for r in recipes:
        assert r.raw["level"] == 1 and r.raw["schema_version"] == "openai-compatible/1"
        assert r.parameters <= {"MODEL_ID"}
    assert by_case()[1].raw["request"]["body"]["model"] == "${MODEL_ID}"


def test_model_id_is_substituted_everywhere_and_a_missing_parameter_is_an_error() -> None:
    rec = by_case()[9]
    filled = rec.render({"MODEL_ID": "m1"})
    assert filled["request"]["body"]["model"] == "m1-not-served-by-this-backend"
    assert "${" not in json.dumps(filled) and "${" in json.dumps(rec.raw)  # the file stays as written
    with pytest.raises(RecipeError, match="MODEL_ID"):
        rec.render({})


def test_recipe_outline_is_checked() -> None:
    with pytest.raises(RecipeError, match="unknown member"):
        parse_recipe({"id": "x", "expect": {}, "expcet": {}})
    with pytest.raises(RecipeError, match="terminal"):
        parse_recipe({"id": "x", "operation": "chat.completions.create", "request": {"body": {}},
                      "expect": {"terminal": "maybe"}})


def test_load_from_a_folder_refuses_duplicate_ids(tmp_path: Path) -> None:
    raw = json.loads((Path(__file__).parents[2] / "coordinator/nnrp/conformance/recipes/01_streaming_text.json")
                     .read_text())
    (tmp_path / "a.json").write_text(json.dumps(raw))
    assert [r.id for r in load_recipes([tmp_path])] == [raw["id"]]
    (tmp_path / "b.json").write_text(json.dumps(raw))
    with pytest.raises(RecipeError, match="used twice"):
        load_recipes([tmp_path])


def test_selection_by_capability() -> None:
    recipes = {c: r.render({"MODEL_ID": "m"}) for c, r in by_case().items()}
    assert all(why_not_selected(r, LEVEL1) is None for r in recipes.values())
    no_tools = build_manifest(ServingCapabilities(tool_calls=False))
    assert "tool_calls" in (why_not_selected(recipes[7], no_tools) or "")
    stream_only = build_manifest(ServingCapabilities(non_streaming=False))
    assert why_not_selected(recipes[1], stream_only) is not None  # no Level 1 claimed at all
    declares_embeddings = parse_manifest({**LEVEL1.to_dict(), "compatibility_levels": [1, 3], "operations": [
        *LEVEL1.to_dict()["operations"],
        {"name": "embeddings.create", "streaming": False, "non_streaming": True, "tool_calls": False}]})
    assert "is declared" in (why_not_selected(recipes[4], declares_embeddings) or "")
    assert why_not_selected({**recipes[1], "schema_version": "openai-compatible/2"}, LEVEL1) is not None


def test_extension_rules_section_10_3() -> None:
    manifest = build_manifest(ServingCapabilities(extensions=(Extension("acme.trace"),
                                                              Extension("acme.strict", critical=True))))
    rec = by_case()[1].render({"MODEL_ID": "m"})
    with_ext = {**rec, "request": {**rec["request"], "extensions": ["acme.trace"]}}
    assert why_not_selected(with_ext, manifest) is None  # non-critical: nothing to ask for
    critical = {**rec, "request": {**rec["request"], "extensions": ["acme.strict"]}}
    assert "not selected" in (why_not_selected(critical, manifest) or "")
    assert why_not_selected(critical, manifest, ["acme.strict"]) is None  # named explicitly
    undeclared = {**rec, "requires": {"extensions": ["other.thing"]}}
    assert "not declared" in (why_not_selected(undeclared, manifest) or "")
    # Judging: non-critical data is ignored, a critical extension the operation did not select is not.
    frames = [{"seq": 0, "event": {"type": "response.output_text.delta", "choice_index": 0, "delta": "hi",
                                   "extensions": {"acme.trace": {"t": 1}}, "openai_chunk": {"x": 1}}},
              {"seq": 1, "event": {"type": "response.completed", "id": "c", "model": "m", "finish_reason": "stop",
                                   "choices": [{"index": 0, "finish_reason": "stop"}]}}]
    plain = ExtensionSelection(manifest.extensions, frozenset())
    assert judge(rec, Observed(frames), plain) == []
    frames[0]["event"]["extensions"] = {"acme.strict": {}}
    assert any("critical" in p for p in judge(rec, Observed(frames), plain))
    assert judge(rec, Observed(frames), ExtensionSelection(manifest.extensions, frozenset({"acme.strict"}))) == []


def test_match_value_types_subsets_and_lists() -> None:
    assert match_value({"a": "<integer>"}, {"a": 3, "b": 1}) is None
    assert match_value({"a": "<integer>"}, {"a": True}) is not None  # a boolean is not an integer
    assert match_value("<string|null>", None) is None
    assert match_value([1], [2, 1]) is None and match_value([3], [2, 1]) is not None
    assert match_value({"a": 1}, {}) == "$.a: missing"
    assert match_value(1, 1.0) is not None


def ev(kind: str, **kw: Any) -> dict[str, Any]:
    return {"type": kind, **kw}


def test_match_events_runs_optional_and_count() -> None:
    pats = [{"type": "response.output_text.delta"}, {"type": "response.usage", "optional": True},
            {"type": "response.completed", "count": 1}]
    d, u, c = ev("response.output_text.delta"), ev("response.usage"), ev("response.completed")
    assert match_events(pats, [d, d, d, c]) is None
    assert match_events(pats, [d, u, c]) is None
    assert match_events(pats, [u, c]) is not None  # at least one delta
    assert match_events(pats, [d, c, c]) is not None  # count 1
    assert match_events(pats, [d, c, d]) is not None  # nothing may trail
    either = [{"type": ["response.output_text.delta", "response.tool_call.delta"]}]
    assert match_events(either, [d, ev("response.tool_call.delta"), d]) is None


def frames_of(*events: dict[str, Any], seqs: list[int] | None = None) -> Observed:
    seqs = seqs if seqs is not None else list(range(len(events)))
    return Observed([{"seq": s, "event": e} for s, e in zip(seqs, events, strict=True)])


def test_judge_cancellation_recipe() -> None:
    rec = by_case()[8].render({"MODEL_ID": "m"})
    sel = ExtensionSelection((), frozenset())
    cancelled = ev("response.cancelled", diagnostics={"source": "client", "operation_id": "conformance-1",
                                                      "reason": "conformance: cancel after the first event",
                                                      "engine_abort_accepted": None})
    d = ev("response.output_text.delta", choice_index=0, delta="x")
    assert judge(rec, frames_of(d, d, cancelled), sel) == []
    assert any("after the terminal" in p for p in judge(rec, frames_of(d, cancelled, d), sel))
    assert any("seq" in p for p in judge(rec, frames_of(d, cancelled, seqs=[0, 2]), sel))
    wrong = ev("response.cancelled", diagnostics={**cancelled["diagnostics"], "source": "timeout"})
    assert judge(rec, frames_of(d, wrong), sel)
    assert any("terminal" in p for p in judge(rec, frames_of(d, ev("response.completed")), sel))


def test_judge_tool_call_recipe_assembles_the_call() -> None:
    rec = by_case()[7].render({"MODEL_ID": "m"})
    sel = ExtensionSelection((), frozenset())
    first = ev("response.tool_call.delta", choice_index=0,
               tool_call={"index": 0, "id": "t1", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": ""}})
    more = [ev("response.tool_call.delta", choice_index=0, tool_call={"index": 0, "function": {"arguments": a}})
            for a in ('{"city": ', '"Berlin"}')]
    done = ev("response.completed", finish_reason="tool_calls")
    assert judge(rec, frames_of(first, *more, done), sel) == []
    broken = ev("response.tool_call.delta", choice_index=0, tool_call={"index": 0, "function": {"arguments": "{"}})
    assert any("not JSON" in p for p in judge(rec, frames_of(first, broken, done), sel))
    assert any("no tool call" in p for p in judge(rec, frames_of(ev("response.output_text.delta", delta="x"),
                                                                  done), sel))


def test_envelope_of_and_non_streaming_twin() -> None:
    rec = by_case()[5].render({"MODEL_ID": "m"})
    env = envelope_of(rec)
    assert env["operation"] == "chat.completions.create" and env["body"]["stream"] is True
    twin = envelope_of(rec, stream=False)
    assert twin["body"]["stream"] is False and "stream_options" not in twin["body"]
    assert rec["request"]["body"]["stream"] is True  # the recipe itself is untouched


def test_table_ends_with_the_count_line_and_exit_code() -> None:
    outcomes = [Outcome("a", "pass"), Outcome("b", "FAIL", "boom"), Outcome("c", "skip", "no tools")]
    out = io.StringIO()
    print_table(outcomes, out)
    assert out.getvalue().splitlines()[-1] == "1 passed, 1 failed"
    assert exit_code(outcomes) == 1
    assert exit_code([Outcome("a", "pass"), Outcome("c", "skip")]) == 0
    assert exit_code([Outcome("c", "skip")]) == 1  # nothing ran is not a pass
    assert http_base("ws://127.0.0.1:8000/nnrp/v1") == "http://127.0.0.1:8000"
    assert http_base("wss://h/x/nnrp/v1") == "https://h/x"
