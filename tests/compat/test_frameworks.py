"""LangChain (``ChatOpenAI``) and LiteLLM as users run them, against the real stack.

Both run from the tool venv (their pins clash with the project's) through small drivers in
``drivers/`` that print what the framework handed back; the assertions are here. Greedy decoding makes
the streamed text comparable with the non-streamed one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.compat.conftest import DRIVERS, compat_bin, offline_env, run_tool, tail
from tests.conftest import SERVED
from tests.support import CoordinatorServer

pytestmark = [pytest.mark.e2e, pytest.mark.compat]


def _drive(script: str, coord: CoordinatorServer, **env: str) -> dict[str, Any]:
    proc = run_tool([compat_bin("python"), DRIVERS / script, f"{coord.url}/v1", SERVED], timeout=300,
                    env=offline_env(**env))
    assert proc.returncode == 0, tail(proc)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_langchain_chat_openai_invoke_stream_batch(compat_coord: CoordinatorServer) -> None:
    out = _drive("langchain_client.py", compat_coord)
    assert "Paris" in out["invoke"]
    assert out["invoke_finish_reason"] in ("stop", "length")
    usage = out["invoke_usage"]
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert out["stream_chunks"] > 1, "the answer did not arrive as a stream"
    assert out["stream_text"] == out["invoke"]
    assert out["stream_finish_reason"] == out["invoke_finish_reason"]
    assert len(out["batch"]) == 2 and all(out["batch"])


def test_litellm_completion_stream_and_not(compat_coord: CoordinatorServer) -> None:
    out = _drive("litellm_client.py", compat_coord, LITELLM_LOCAL_MODEL_COST_MAP="True")
    assert "Paris" in out["content"] and out["role"] == "assistant"
    assert out["finish_reason"] in ("stop", "length")
    assert out["stream_chunks"] > 1
    assert out["stream_text"] == out["rebuilt_content"] == out["content"]
    assert out["rebuilt_role"] == "assistant"
    for usage in (out["usage"], out["stream_usage"]):
        assert usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert out["stream_usage"]["completion_tokens"] == out["usage"]["completion_tokens"]


def test_langchain_chat_openai_on_the_responses_api(compat_coord: CoordinatorServer) -> None:
    """LangChain's Responses mode: a greedy answer, the same answer streamed, and a follow-up turn whose
    history holds LangChain's own Responses output items."""
    out = _drive("langchain_responses_client.py", compat_coord)
    assert "Paris" in out["invoke"]
    assert out["invoke_id"].startswith("resp_") and out["invoke_status"] == "completed"
    usage = out["invoke_usage"]
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert out["stream_chunks"] > 1, "the answer did not arrive as a stream"
    assert out["stream_text"] == out["invoke"]
    assert "Rome" in out["follow_up"]
