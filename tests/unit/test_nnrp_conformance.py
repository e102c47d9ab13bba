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
    completed_text,
    delta_text,
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
# What the coordinator declares with its Responses conversion and model catalog wired.
SERVER = build_manifest(ServingCapabilities(tool_calls=True, responses=True, models_list=True))


def by_case() -> dict[int, Any]:
    return {r.case: r for r in load_recipes() if r.case is not None}


def by_operation(operation: str) -> dict[str, Any]:
    """The packaged recipes of one operation above Level 1, by id, parameters filled."""
    return {r.id: r.render({"MODEL_ID": "m"}) for r in load_recipes()
            if r.raw.get("operation") == operation and r.raw["level"] > 1}


def test_ten_level1_recipes_are_packaged_one_per_case() -> None:
    recipes = [r for r in load_recipes() if r.raw["level"] == 1]
    assert sorted(r.case or 0 for r in recipes) == list(range(1, 11))
    assert len({r.id for r in recipes}) == 10
    for r in load_recipes():
        assert r.raw["schema_version"] == "openai-compatible/1"
        assert r.parameters <= {"MODEL_ID"}
    assert by_case()[1].raw["request"]["body"]["model"] == "${MODEL_ID}"


def test_responses_and_models_list_recipes_are_packaged_at_their_levels() -> None:
    above = [r for r in load_recipes() if r.raw["level"] > 1]
    assert sorted((r.raw["level"], r.raw["operation"]) for r in above) == [
        (2, "responses.create"), (2, "responses.create"), (2, "responses.create"), (3, "models.list")]
    assert all(r.case is None for r in above)  # case numbers are Level 1's
    modes = sorted(r["request"]["body"].get("stream") is True for r in by_operation("responses.create").values())
    assert modes == [False, True, True]  # streaming, non-streaming and a refusal


def test_level_2_and_3_recipes_run_only_where_the_manifest_serves_them() -> None:
    for recipe in [*by_operation("responses.create").values(), *by_operation("models.list").values()]:
        assert "is not claimed" in (why_not_selected(recipe, LEVEL1) or "")
        assert why_not_selected(recipe, SERVER) is None
    listing = next(iter(by_operation("models.list").values()))
    streamed = {**listing, "request": {"body": {"stream": True}}}
    assert "not declared streaming" in (why_not_selected(streamed, SERVER) or "")


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


def numbered(*events: dict[str, Any], start: int = 0) -> list[dict[str, Any]]:
    return [{**e, "sequence_number": start + i} for i, e in enumerate(events)]


def responses_stream(text: str = "Hi there") -> list[dict[str, Any]]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    started = {"object": "response", "status": "in_progress", "output": []}
    done = {"object": "response", "status": "completed", "output": [item],
            "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}}
    return numbered(ev("response.created", response=started), ev("response.in_progress", response=started),
                    ev("response.output_item.added", output_index=0, item={**item, "content": []}),
                    ev("response.content_part.added", output_index=0, content_index=0),
                    *(ev("response.output_text.delta", output_index=0, content_index=0, delta=d)
                      for d in (text[:2], text[2:])),
                    ev("response.output_text.done", output_index=0, content_index=0, text=text),
                    ev("response.content_part.done", output_index=0, content_index=0),
                    ev("response.output_item.done", output_index=0, item=item),
                    ev("response.completed", response=done))


def test_judge_responses_streaming_recipe() -> None:
    rec = by_operation("responses.create")["openai-compatible.responses.streaming"]
    sel = ExtensionSelection((), frozenset())
    events = responses_stream()
    assert judge(rec, frames_of(*events), sel) == []
    gap = [*events[:3], *numbered(*events[3:], start=4)]
    assert any("sequence_number" in p for p in judge(rec, frames_of(*gap), sel))
    assert judge(rec, frames_of(*events[1:]), sel)  # no response.created
    no_message = {**events[-1], "response": {**events[-1]["response"], "output": []}}
    assert judge(rec, frames_of(*events[:-1], no_message), sel)
    chat_like = ev("response.completed", id="c", model="m", finish_reason="stop", choices=[])
    assert judge(rec, frames_of(*events[:-1], chat_like), sel)  # a chat terminal is not a Responses one
    assert delta_text(events) == "Hi there" == completed_text(events[-1])


def test_judge_models_list_and_responses_refusal_recipes() -> None:
    sel = ExtensionSelection((), frozenset())
    listing = next(iter(by_operation("models.list").values()))
    cards = [{"id": "other", "object": "model"}, {"id": "m", "object": "model", "parent": None}]
    assert judge(listing, frames_of(ev("response.completed", response={"object": "list", "data": cards})),
                 sel) == []
    assert judge(listing, frames_of(ev("response.completed", response={"object": "list", "data": cards[:1]})),
                 sel)  # the model under test is missing
    refusal = by_operation("responses.create")["openai-compatible.responses.invalid-request"]
    error = {"message": "previous_response_id is not supported", "type": "BadRequestError",
             "param": "previous_response_id", "code": 400}
    assert judge(refusal, frames_of(ev("response.error", status=400, error=error)), sel) == []
    assert judge(refusal, frames_of(ev("response.error", status=400, error={**error, "param": "input"})), sel)


def test_completed_text_reads_chat_and_responses() -> None:
    chat = ev("response.completed", response={"object": "chat.completion",
                                              "choices": [{"message": {"content": "Paris."}}]})
    assert completed_text(chat) == "Paris."
    response = {"object": "response", "output": [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "content": [{"type": "output_text", "text": "Par"}, {"type": "refusal"},
                                        {"type": "output_text", "text": "is."}]}]}
    assert completed_text(ev("response.completed", response=response)) == "Paris."


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
