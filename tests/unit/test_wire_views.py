"""The typed wire views (``coordinator/contracts/generate.py``) name exactly the fields the installed
vLLM's generate protocol has: a field vLLM renames or adds shows up here, not as a silent KeyError
in a stream."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.contracts import generate as views

protocol = pytest.importorskip("vllm.entrypoints.scale_out.token_in_token_out.protocol")
sampling = pytest.importorskip("vllm.sampling_params")
serve = pytest.importorskip("vllm.entrypoints.serve.engine.protocol")

OURS = {"GenerateRequest": {"block_hashes"}}  # what the coordinator and its sidecar add


@pytest.mark.parametrize(("view", "model"), [
    (views.GenerateRequest, protocol.GenerateRequest),
    (views.Choice, protocol.GenerateTokensChoice),
    (views.Choice, protocol.GenerateTokensStreamChoice),
    (views.GenerateResponse, protocol.GenerateTokensResponse),
    (views.StreamChunk, protocol.GenerateTokensStreamResponse),
    (views.LogProbs, protocol.GenerateLogProbs),
    (views.LogProbsContent, protocol.GenerateLogProbsContent),
    (views.Usage, serve.UsageInfo),
])
def test_a_view_names_the_fields_of_vllms_model(view: Any, model: Any) -> None:
    mine = set(view.__required_keys__ | view.__optional_keys__)
    assert mine - OURS.get(view.__name__, set()) == set(model.model_fields)


def test_the_sampling_view_names_every_public_field_of_sampling_params() -> None:
    public = {f for f in sampling.SamplingParams.__struct_fields__ if not f.startswith("_")}
    assert set(views.SamplingParams.__optional_keys__) == public
