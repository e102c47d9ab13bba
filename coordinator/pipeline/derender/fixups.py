"""Where vLLM's derender output differs from native ``vllm serve``, the coordinator corrects it here.

Each correction names the native behaviour it restores (vLLM 0.32 source):

* **The stopping token is not text.** The native detokenizer skips the token that ended generation
  (EOS or a ``stop_token_ids`` entry) unless ``include_stop_str_in_output``
  (``v1/engine/detokenizer.py``, ``update``). Derender decodes every id it is given, and with a
  parser configured it keeps special tokens, so ``<|im_end|>`` or a stop token's text would leak into
  the content. The token still counts in usage and keeps its logprobs entry, as natively.
* **Tool calls finish with ``tool_calls``.** Native chat serving reports ``finish_reason:
  "tool_calls"`` when the auto tool parser found calls (or ``tool_choice: "required"`` ended
  normally); batch derender passes the engine's ``"stop"`` through.
* **EOS has no ``stop_reason``.** A native engine knows the tokenizer's EOS and finishes on it with
  ``stop_reason: null`` (``v1/core/sched/utils.py``, ``check_stop``); a ``--tokens-only`` engine has
  no tokenizer, takes EOS from the generation config into ``stop_token_ids`` and reports it as
  ``stop_reason: 2``. A stop token the client did not ask for is therefore reported as ``null``.
* **``return_token_ids`` returns the prompt's ids too.** Native puts ``prompt_token_ids`` at the top
  of a chat answer and on each completion choice (a stream: on the first chunk of each choice), and
  the output ids on every choice; derender of a completion leaves both ``null`` and has no prompt to
  report for chat (it is given a one-message stub). The coordinator has both sets of ids.
* **The answer's role is the request's.** With ``add_generation_prompt: false`` native answers in
  the last message's role (``get_chat_request_role``); batch derender always says ``assistant``.
* **A completion's ``top_logprobs`` hold k + 1 entries when the sampled token is not in the top k.**
  Native completions show the sampled token and the top k (``_create_completion_logprobs``); the
  generate route cuts every position to k entries, as chat does. So the engine is asked for k + 1
  (``widen_completion_logprobs``) and each position is cut back to what native shows: k entries
  when the sampled token ranks within k, else k + 1 (``native_top_logprobs``). At k = 20, vLLM's
  default ``--max-logprobs``, the engine cannot be asked for more and such positions show 20.
* **``logprob_token_ids`` come back whole.** Native returns, at each position, the sampled token and
  every id asked for (``_get_top_logprobs(return_all=True)``); the generate route cuts each position
  to ``sampling_params.logprobs`` entries, and render leaves that unset when ids are named, so none
  would come back. vLLM requires ``logprobs`` to equal the number of ids when both are set, so the
  engine is asked with the first id named once more at the end and ``logprobs`` one above the
  client's count (``widen_logprob_token_ids``): the engine's entries for a position are the sampled
  token then the ids, the repeat lands on a key already there, and the cut then keeps them all. The
  one trace is the repeated id's ``rank`` in the engine's answer, which no OpenAI answer shows. Both
  the engine and the sidecar's derender hold a position to ``--max-logprobs`` entries (20), so 19
  ids can be named here where native takes 128 (``MAX_LOGPROB_TOKEN_IDS``, a 400 above it).
* **Tool-call deltas carry only what is set.** Native chunks are written with
  ``exclude_unset``; derender's chunks have explicit ``null`` for ``id``/``type``/``name`` after the
  first fragment, which the OpenAI SDK's stream helper then copies over the real values.
"""

from __future__ import annotations

from typing import Any

from coordinator.pipeline.context import StopSpec
from coordinator.pipeline.token_ids import ENGINE_MAX_LOGPROBS


def stops_on_token(choice: dict[str, Any], spec: StopSpec) -> bool:
    """The engine choice ended on a stop token (EOS or ``stop_token_ids``) whose text must be hidden."""
    return (choice.get("finish_reason") == "stop" and not isinstance(choice.get("stop_reason"), str)
            and not spec.include_in_output and bool(choice.get("token_ids")))


def without_stop_token(choice: dict[str, Any]) -> dict[str, Any]:
    return {**choice, "token_ids": list(choice["token_ids"])[:-1]}


def eos_stop_reason(choice: dict[str, Any], client_stop_token_ids: Any) -> None:
    """Output choice: an integer ``stop_reason`` the client did not ask for was EOS; native says null."""
    reason = choice.get("stop_reason")
    if type(reason) is int and reason not in (client_stop_token_ids or ()):
        choice["stop_reason"] = None


def tool_call_finish_reason(choice: dict[str, Any], tool_choice: Any) -> None:
    """Batch chat choice: ``finish_reason`` as native serving reports it when tools were called."""
    msg = choice.get("message") or {}
    if not msg.get("tool_calls") or isinstance(tool_choice, dict):
        return  # a named tool choice keeps the engine's reason natively as well
    if tool_choice in (None, "auto") or (tool_choice == "required" and choice.get("finish_reason") == "stop"):
        choice["finish_reason"] = "tool_calls"


def widen_logprob_token_ids(sampling_params: dict[str, Any]) -> None:
    """``sampling_params`` naming ``logprob_token_ids``: asked so that the token route returns them all."""
    ids = sampling_params.get("logprob_token_ids")
    if isinstance(ids, list) and ids and sampling_params.get("logprobs") is None:
        sampling_params["logprob_token_ids"] = [*ids, ids[0]]
        sampling_params["logprobs"] = len(ids) + 1


def widen_completion_logprobs(sampling_params: dict[str, Any]) -> None:
    """A completion's ``sampling_params``: ask for one alternative more than the client did."""
    k = sampling_params.get("logprobs")
    if type(k) is int and 0 < k < ENGINE_MAX_LOGPROBS:
        sampling_params["logprobs"] = k + 1


def native_top_logprobs(choice: dict[str, Any], body: dict[str, Any]) -> None:
    """An engine choice of a completion asking for ``k`` logprobs: each position's alternatives cut
    to what native shows (they come sampled token first, then by rank). Named ids are shown whole."""
    k = None if body.get("logprob_token_ids") else body.get("logprobs")
    lp = choice.get("logprobs")
    if type(k) is not int or not 0 < k < ENGINE_MAX_LOGPROBS or not isinstance(lp, dict):
        return
    for entry in lp.get("content") or ():
        tops = entry.get("top_logprobs")
        if tops:
            rank = entry.get("rank")
            entry["top_logprobs"] = tops[:k if isinstance(rank, int) and 0 < rank <= k else k + 1]


def answer_role(choice: dict[str, Any], body: dict[str, Any]) -> None:
    """Batch chat choice: the message's role as native sets it."""
    messages = body.get("messages") or []
    message = choice.get("message")
    if body.get("add_generation_prompt", True) is False and messages and isinstance(message, dict):
        message["role"] = messages[-1].get("role")


def compact_tool_call_deltas(choice: dict[str, Any]) -> None:
    """Streamed chat choice: drop ``null`` members of tool-call deltas (only when there are any)."""
    calls = (choice.get("delta") or {}).get("tool_calls")
    if not calls:
        return
    for call in calls:
        for key in [k for k, v in call.items() if v is None]:
            del call[key]
        fn = call.get("function")
        if isinstance(fn, dict):
            for key in [k for k, v in fn.items() if v is None]:
                del fn[key]


def attach_token_ids(kind: str, out: dict[str, Any], prompts: list[tuple[list[int], int]],
                     outputs: dict[int, list[int]]) -> None:
    """A non-streaming answer with ``return_token_ids``: ``prompts`` is each prompt's ids and ``n``
    in order; ``outputs`` maps a choice's global index to the engine's ids for it."""
    if kind == "chat":
        if prompts:
            out["prompt_token_ids"] = prompts[0][0]
    by_index = {p * n + c: ids for p, (ids, n) in enumerate(prompts) for c in range(n)}
    for choice in out.get("choices", []):
        index = int(choice.get("index", 0))
        if index in outputs:
            choice["token_ids"] = outputs[index]
        if kind != "chat" and index in by_index:
            choice["prompt_token_ids"] = by_index[index]


def stream_token_ids(choice: dict[str, Any], ids: list[int], prompt_ids: list[int] | None) -> None:
    """A completion stream's chunk with ``return_token_ids``: this chunk's output ids, and the prompt's
    ids on the choice's first chunk (``prompt_ids``, None after it), as native sends them."""
    choice["token_ids"] = ids
    choice["prompt_token_ids"] = prompt_ids
