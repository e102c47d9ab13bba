"""A grammar stream's relay regenerates the request and checks off what the client already has
(``topology/engine_stream.py``): the kept tokens, the seed it is given, and the divergence rule.
The whole relay on real engines is tests/e2e/test_relay_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.pipeline.context import PromptPlan, RequestContext, StopSpec
from coordinator.pipeline.errors import RelayDiverged
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.engine_stream import EngineStream

GRAMMAR = {"json": {"type": "object"}}


class Topology:
    def sched_request(self, ctx: RequestContext, plan: PromptPlan, generate: dict[str, Any]) -> SchedRequest:
        return SchedRequest("r", "m", plan.prompt_token_ids, 8)


def stream(**sp: Any) -> EngineStream:
    plan = PromptPlan(index=0, generate={"request_id": "r", "sampling_params": {"max_tokens": 8, **sp}},
                      prompt_token_ids=[1, 2, 3], n=1, stop=StopSpec(()))
    ctx = RequestContext(kind="chat", request_id="r", body={}, model="m", stream=True, include_usage=False,
                         prompts=[plan])
    return EngineStream(None, Topology(), ctx, plan)  # type: ignore[arg-type]


def chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish,
                                                        "logprobs": {"content": [{"token_id": i} for i in ids]}}]}


def test_a_sampled_grammar_stream_gets_a_seed_and_a_greedy_or_plain_one_does_not() -> None:
    sampled = stream(structured_outputs=GRAMMAR, temperature=0.7)._plan.generate["sampling_params"]
    assert isinstance(sampled["seed"], int)
    assert "seed" not in stream(structured_outputs=GRAMMAR, temperature=0)._plan.generate["sampling_params"]
    assert stream(structured_outputs=GRAMMAR, seed=5)._plan.generate["sampling_params"]["seed"] == 5
    assert "seed" not in stream(temperature=0.7)._plan.generate["sampling_params"]


def test_tokens_the_client_has_are_checked_off_and_the_rest_goes_on() -> None:
    es = stream(structured_outputs=GRAMMAR, temperature=0)
    es._expected = [10, 11, 12]
    assert es._regenerated(chunk([10, 11])) is None          # all known: nothing to hand out
    out = es._regenerated(chunk([12, 13, 14]))
    assert out is not None and "prompt_token_ids" not in out
    assert out["choices"][0]["token_ids"] == [13, 14]
    assert [e["token_id"] for e in out["choices"][0]["logprobs"]["content"]] == [13, 14]
    assert es._expected == []


def test_different_tokens_end_the_stream_instead_of_splicing_two_documents() -> None:
    es = stream(structured_outputs=GRAMMAR, temperature=0)
    es._expected = [10, 11, 12]
    with pytest.raises(RelayDiverged):
        es._regenerated(chunk([10, 99]))
