"""Token obfuscation: the keyed permutation, every id field of the wire mapped both ways, the engine
client wrapper, the startup wiring and the obfuscated model copy (on a tiny synthetic model)."""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.config import EngineClientSettings, ModelSettings, Settings
from coordinator.contracts.permutation import KeyedPermutation, ObfuscationError, Obfuscator
from coordinator.pipeline.engines.client import EngineClient
from coordinator.pipeline.engines.obfuscating import (
    ObfuscatingEngineClient,
    build_engine_client,
    permuted_vocab_size,
)
from coordinator.pipeline.errors import BadRequest, UpstreamUnavailable
from coordinator.pipeline.obfuscation import (
    UnmappableField,
    chunk_to_semantic,
    request_to_physical,
    request_to_semantic,
    response_to_physical,
    response_to_semantic,
)

KEY = b"k" * 16 + b"0123456789abcdef"
V = 1000


@pytest.fixture(scope="module")
def perm() -> KeyedPermutation:
    return KeyedPermutation(V, KEY)


# -- the permutation ---------------------------------------------------------------------------------

def test_is_a_bijection_and_its_inverse(perm: KeyedPermutation) -> None:
    physical = perm.to_physical(range(V))
    assert sorted(physical) == list(range(V))
    assert perm.to_semantic(physical) == list(range(V))
    assert sum(p == s for s, p in enumerate(physical)) < 10  # not (close to) the identity
    assert isinstance(perm, Obfuscator)


def test_deterministic_per_key_and_size() -> None:
    a, b = KeyedPermutation(V, KEY), KeyedPermutation(V, KEY)
    assert a.physical_table() == b.physical_table() and a.fingerprint == b.fingerprint
    other_key = KeyedPermutation(V, KEY[:-1] + b"!")
    other_size = KeyedPermutation(V + 1, KEY)
    assert other_key.physical_table() != a.physical_table() and other_key.fingerprint != a.fingerprint
    assert other_size.physical_table()[:V] != a.physical_table() and other_size.fingerprint != a.fingerprint
    assert KEY.hex() not in repr(a) and str(a.physical_table()[:3])[1:-1] not in repr(a)


def test_keys_and_ids_are_checked(tmp_path: Path, perm: KeyedPermutation) -> None:
    with pytest.raises(ObfuscationError, match="at least 16 bytes"):
        KeyedPermutation(V, b"short")
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"")
    with pytest.raises(ObfuscationError, match="holds 0 bytes"):
        KeyedPermutation.from_key_file(V, empty)
    with pytest.raises(ObfuscationError, match="cannot read"):
        KeyedPermutation.from_key_file(V, tmp_path / "missing.key")
    good = tmp_path / "good.key"
    good.write_bytes(KEY)
    assert KeyedPermutation.from_key_file(V, good).physical_table() == perm.physical_table()
    for bad in ([V], [-1], [0, V + 5]):  # a negative id must not wrap around the table
        with pytest.raises(ObfuscationError, match="outside"):
            perm.to_physical(bad)
        with pytest.raises(ObfuscationError, match="outside"):
            perm.to_semantic(bad)
    assert perm.to_physical([]) == []


# -- wire mapping --------------------------------------------------------------------------------------

def request() -> dict[str, Any]:
    return {
        "request_id": "chatcmpl-1", "token_ids": [1, 2, 3, 999], "model": "m", "stream": True,
        "features": None, "kv_transfer_params": {"do_remote_decode": True},
        "sampling_params": {
            "max_tokens": 5, "temperature": 0.0, "stop": [], "n": 2,
            "stop_token_ids": [2, 7], "allowed_token_ids": [5, 6, 7, 8],
            "logit_bias": {"5": 10.0, "0": -100.0}, "logprob_token_ids": [9, 10],
            "trace_decode_token_ids": [11], "prompt_logprob_token_ids": [[12, -1], [-1, 13]],
            "bad_words": [[14, 15]], "_bad_words_token_ids": [[16]],
            "extra_args": {"kv_transfer_params": {"x": 1}},
        },
    }


def p(perm: KeyedPermutation, *ids: int) -> list[int]:
    return perm.to_physical(list(ids))


def test_request_every_id_field_is_mapped(perm: KeyedPermutation) -> None:
    body = request()
    before = copy.deepcopy(body)
    out = request_to_physical(body, perm)
    assert body == before, "the caller's body must not change (it is sent again on a retry)"
    sp = out["sampling_params"]
    assert out["token_ids"] == p(perm, 1, 2, 3, 999)
    assert sp["stop_token_ids"] == p(perm, 2, 7)
    assert sp["allowed_token_ids"] == p(perm, 5, 6, 7, 8)
    assert sp["logit_bias"] == {str(p(perm, 5)[0]): 10.0, str(p(perm, 0)[0]): -100.0}
    assert sp["logprob_token_ids"] == p(perm, 9, 10)
    assert sp["trace_decode_token_ids"] == p(perm, 11)
    assert sp["prompt_logprob_token_ids"] == [[p(perm, 12)[0], -1], [-1, p(perm, 13)[0]]]
    assert sp["bad_words"] == [p(perm, 14, 15)]
    assert sp["_bad_words_token_ids"] == [p(perm, 16)]
    # Everything that is not a token id is passed through as it is.
    for key in ("request_id", "model", "stream", "features", "kv_transfer_params"):
        assert out[key] == body[key]
    for key in ("max_tokens", "temperature", "stop", "n", "extra_args"):
        assert sp[key] == body["sampling_params"][key]
    assert request_to_semantic(out, perm) == body


def test_int_logit_bias_keys_stay_ints(perm: KeyedPermutation) -> None:
    out = request_to_physical({"token_ids": [1], "sampling_params": {"logit_bias": {3: 1.0}}}, perm)
    assert out["sampling_params"]["logit_bias"] == {p(perm, 3)[0]: 1.0}


def test_fields_the_engine_would_tokenize_itself_are_refused(perm: KeyedPermutation) -> None:
    with pytest.raises(UnmappableField) as e:
        request_to_physical({"token_ids": [1], "sampling_params": {"bad_words": ["hello"]}}, perm)
    assert e.value.field == "bad_words"
    with pytest.raises(UnmappableField) as e:
        request_to_physical({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}},
                            perm)
    assert e.value.field == "structured_outputs"
    # Unset (null / empty) is fine.
    request_to_physical({"token_ids": [1], "sampling_params": {"bad_words": [], "structured_outputs": None}},
                        perm)


def response() -> dict[str, Any]:
    """A GenerateTokensResponse as vLLM 0.32 writes it (semantic ids here)."""
    return {
        "request_id": "generate-tokens-x", "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "prompt_token_ids": [1, 2, 3], "prompt_logprobs": [None, {"2": {"logprob": -1.0, "rank": 1}}],
        "kv_transfer_params": {"remote_block_ids": [1, 2]},
        "choices": [
            {"index": 0, "finish_reason": "stop", "stop_reason": 7, "token_ids": [40, 7],
             "sampling_mask": [[40, 41], [7]], "weight_versions": [{"version": "default", "start": 0, "end": 2}],
             "logprobs": {"content": [
                 {"token_id": 40, "logprob": -0.1, "rank": 1,
                  "top_logprobs": [{"token_id": 40, "logprob": -0.1, "rank": 1},
                                   {"token_id": 41, "logprob": -2.0, "rank": 2}]},
                 {"token_id": 7, "logprob": -0.3, "rank": None, "top_logprobs": []}]}},
            {"index": 1, "finish_reason": "stop", "stop_reason": "END", "token_ids": [3], "logprobs": None},
            {"index": 2, "finish_reason": "length", "stop_reason": None, "token_ids": [], "logprobs": None},
        ],
    }


def test_response_every_id_field_is_mapped_back(perm: KeyedPermutation) -> None:
    semantic = response()
    physical = response_to_physical(semantic, perm)
    c0 = physical["choices"][0]
    assert physical["prompt_token_ids"] == p(perm, 1, 2, 3)
    assert physical["prompt_logprobs"] == [None, {str(p(perm, 2)[0]): {"logprob": -1.0, "rank": 1}}]
    assert c0["token_ids"] == p(perm, 40, 7) and c0["stop_reason"] == p(perm, 7)[0]
    assert c0["sampling_mask"] == [p(perm, 40, 41), p(perm, 7)]
    entry = c0["logprobs"]["content"][0]
    assert entry["token_id"] == p(perm, 40)[0]
    assert [t["token_id"] for t in entry["top_logprobs"]] == p(perm, 40, 41)
    assert entry["logprob"] == -0.1 and entry["top_logprobs"][1]["rank"] == 2
    assert physical["choices"][1]["stop_reason"] == "END"  # a stop string is not an id
    assert physical["choices"][2]["stop_reason"] is None
    assert physical["kv_transfer_params"] == semantic["kv_transfer_params"]  # block ids, not token ids
    before = copy.deepcopy(physical)
    assert response_to_semantic(physical, perm) == semantic
    assert physical == before


def test_stream_chunks_are_mapped_back(perm: KeyedPermutation) -> None:
    first = {"request_id": "r", "usage": None, "prompt_token_ids": p(perm, 1, 2), "output_mode": "tokens",
             "choices": [{"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": p(perm, 5),
                          "logprobs": {"content": [{"token_id": p(perm, 5)[0], "logprob": -1.0, "rank": 1,
                                                    "top_logprobs": []}]}}]}
    out = chunk_to_semantic(first, perm)
    assert out["prompt_token_ids"] == [1, 2] and out["choices"][0]["token_ids"] == [5]
    assert out["choices"][0]["logprobs"]["content"][0]["token_id"] == 5
    last = {"request_id": "r", "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": p(perm, 2)[0],
                                            "token_ids": p(perm, 2)}]}
    assert chunk_to_semantic(last, perm)["choices"][0] == {"index": 0, "finish_reason": "stop",
                                                            "stop_reason": 2, "token_ids": [2]}
    usage = {"request_id": "r", "usage": {"prompt_tokens": 2}, "output_mode": "tokens", "choices": []}
    assert chunk_to_semantic(usage, perm) == usage


# -- the engine client ---------------------------------------------------------------------------------

ENGINE: Any = SimpleNamespace(url="http://engine")


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch, perm: KeyedPermutation) -> dict[str, Any]:
    """The plain client's network calls replaced: records what it was asked to send, answers in
    physical ids (as an engine serving the obfuscated copy does)."""
    seen: dict[str, Any] = {"reply": None}

    async def generate(self: EngineClient, engine: Any, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        seen["generate"] = body
        return seen["reply"] or response_to_physical(response(), perm)

    @contextlib.asynccontextmanager
    async def stream(self: EngineClient, engine: Any, body: dict[str, Any], request_id: str,
                     include_usage: bool) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        seen["stream"] = body

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for t in body["token_ids"]:
                yield {"request_id": "r", "choices": [{"index": 0, "token_ids": [t], "finish_reason": None}]}

        yield chunks()

    monkeypatch.setattr(EngineClient, "generate", generate)
    monkeypatch.setattr(EngineClient, "stream", stream)
    return seen


async def test_client_sends_physical_and_returns_semantic(wire: dict[str, Any], perm: KeyedPermutation) -> None:
    client = ObfuscatingEngineClient(EngineClientSettings(), perm)
    try:
        body = request()
        assert await client.generate(ENGINE, body, "rid") == response()
        assert wire["generate"] == request_to_physical(body, perm) and body == request()
        async with client.stream(ENGINE, body, "rid", include_usage=False) as chunks:
            got = [c["choices"][0]["token_ids"][0] async for c in chunks]
        assert wire["stream"]["token_ids"] == p(perm, 1, 2, 3, 999) != body["token_ids"]
        assert got == body["token_ids"]  # each physical id came back as its semantic one
    finally:
        await client.aclose()
    assert client.obfuscator is perm
    assert EngineClient(EngineClientSettings()).obfuscator is None  # a plain client sends ids as they are


async def test_client_errors(wire: dict[str, Any], perm: KeyedPermutation) -> None:
    client = ObfuscatingEngineClient(EngineClientSettings(), perm)
    try:
        with pytest.raises(BadRequest) as e:
            await client.generate(ENGINE, {"token_ids": [1], "sampling_params": {"bad_words": ["x"]}}, "r")
        assert e.value.param == "bad_words" and "generate" not in wire
        with pytest.raises(BadRequest):
            await client.generate(ENGINE, {"token_ids": [V], "sampling_params": {}}, "r")
        wire["reply"] = {"choices": [{"index": 0, "token_ids": [V + 1]}]}
        with pytest.raises(UpstreamUnavailable, match="unmappable"):
            await client.generate(ENGINE, {"token_ids": [1], "sampling_params": {}}, "r")
    finally:
        await client.aclose()


# -- wiring and settings -----------------------------------------------------------------------------

def settings(tmp_path: Path, models: list[ModelSettings], enabled: bool = True) -> Settings:
    key = tmp_path / "token.key"
    key.write_bytes(KEY)
    return Settings(models=models, obfuscation={"enabled": enabled, "key_file": str(key)})


def test_enabled_needs_a_key_file() -> None:
    with pytest.raises(ValidationError, match="key_file"):
        Settings(obfuscation={"enabled": True})
    assert Settings().obfuscation.enabled is False


async def test_build_engine_client(tmp_path: Path) -> None:
    plain = build_engine_client(settings(tmp_path, [ModelSettings(name="a")], enabled=False))
    assert type(plain) is EngineClient
    client = build_engine_client(settings(tmp_path, [ModelSettings(name="a", vocab_size=V)]))
    assert isinstance(client, ObfuscatingEngineClient)
    assert client.obfuscator.to_physical(range(V)) == KeyedPermutation(V, KEY).to_physical(range(V))
    await plain.aclose()
    await client.aclose()


def test_vocab_size_comes_from_the_model_folder_first(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 777}}))
    s = settings(tmp_path, [ModelSettings(name="a", path=str(folder), vocab_size=800)])
    assert permuted_vocab_size(s) == 777
    with pytest.raises(ObfuscationError, match="vocabulary size of model 'a'"):
        permuted_vocab_size(settings(tmp_path, [ModelSettings(name="a")]))
    with pytest.raises(ObfuscationError, match="differ"):
        permuted_vocab_size(settings(tmp_path, [ModelSettings(name="a", vocab_size=5),
                                                ModelSettings(name="b", vocab_size=6)]))


# -- the obfuscated model copy ---------------------------------------------------------------------------

def test_config_ids_are_mapped(perm: KeyedPermutation) -> None:
    from token_engine.model_prep import map_config_ids

    table = perm.physical_table()
    config = {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None, "vocab_size": V,
              "hidden_size": 4, "suppress_tokens": [4], "bad_words_ids": [[5, 6]], "image_token_id": V + 10,
              "text_config": {"eos_token_id": 2}}
    out = map_config_ids(config, table, log=lambda _: None)
    assert out == {**config, "bos_token_id": table[1], "eos_token_id": [table[2], table[3]],
                   "suppress_tokens": [table[4]], "bad_words_ids": [[table[5], table[6]]],
                   "text_config": {"eos_token_id": table[2]}}  # an id beyond the vocabulary stays


def test_obfuscated_copy_of_a_tiny_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    from safetensors.torch import load_file

    from token_engine.model_prep import OBFUSCATED_MARKER, write_obfuscated_copy

    vocab, hidden = 50, 4
    source = tmp_path / "src"
    source.mkdir()
    embed = torch.arange(vocab * hidden, dtype=torch.float32).reshape(vocab, hidden)
    norm = torch.ones(hidden)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, str(source / "model.safetensors"),
              metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": 2,
                                                    "tie_word_embeddings": True}))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    (source / "tokenizer.json").write_text("{}")
    (source / "chat_template.jinja").write_text("{{ x }}")
    (source / "README.md").write_text("hi")
    key = tmp_path / "k"
    key.write_bytes(KEY)
    lines: list[str] = []
    dest = write_obfuscated_copy(source, tmp_path / "copy", key, log=lines.append)
    perm = KeyedPermutation(vocab, KEY)
    t = perm.physical_table()

    tensors = load_file(str(dest / "model.safetensors"))
    for s in range(vocab):  # physical row perm(s) holds semantic row s
        assert torch.equal(tensors["model.embed_tokens.weight"][t[s]], embed[s])
    assert torch.equal(tensors["model.norm.weight"], norm)
    assert json.loads((dest / "config.json").read_text())["eos_token_id"] == t[2]
    assert json.loads((dest / "generation_config.json").read_text()) == {"eos_token_id": [t[2], t[0]],
                                                                         "bos_token_id": t[1]}
    assert not (dest / "tokenizer.json").exists() and not (dest / "chat_template.jinja").exists()
    assert (dest / "README.md").read_text() == "hi"
    marker = json.loads((dest / OBFUSCATED_MARKER).read_text())
    assert marker["fingerprint"] == perm.fingerprint and marker["permuted"] == ["model.embed_tokens.weight"]
    assert any("permuted model.embed_tokens.weight" in line for line in lines)  # progress is shown

    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    lines.clear()
    write_obfuscated_copy(source, dest, key, log=lines.append)  # same key: nothing rewritten
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime
    assert any("already written" in line for line in lines)

    other = tmp_path / "k2"
    other.write_bytes(KEY[::-1])
    write_obfuscated_copy(source, dest, other, log=lines.append)  # another key: rewritten
    t2 = KeyedPermutation(vocab, KEY[::-1]).physical_table()
    assert json.loads((dest / "config.json").read_text())["eos_token_id"] == t2[2]
    assert not list(tmp_path.glob(".copy.partial-*"))
