"""NNRP v1 frame codecs: every bad input is a typed FrameError, never another exception."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from coordinator.nnrp import frames as F

MAX = 4096


def test_json_and_msgpack_decode_to_the_same_frame() -> None:
    raw = {"type": "submit", "op": "a", "envelope": {"x": 1}, "credits": 3}
    assert F.decode(json.dumps(raw), max_bytes=MAX) == F.decode(msgspec.msgpack.encode(raw), max_bytes=MAX)
    frame = F.decode(json.dumps(raw), max_bytes=MAX)
    assert isinstance(frame, F.Submit) and frame.op == "a" and frame.credits == 3
    assert F.frame_type(frame) == "submit"


@pytest.mark.parametrize(("data", "code"), [
    ("{", F.MALFORMED_FRAME),
    (b"\xc1", F.MALFORMED_FRAME),
    ("[1, 2]", F.MALFORMED_FRAME),
    ('{"op": "a"}', F.UNKNOWN_TYPE),
    ('{"type": "launch"}', F.UNKNOWN_TYPE),
    ('{"type": 3}', F.UNKNOWN_TYPE),
    ('{"type": "submit", "envelope": {}}', F.MALFORMED_FRAME),
    ('{"type": "submit", "op": "", "envelope": {}}', F.MALFORMED_FRAME),
    ('{"type": "credit", "op": "a", "credits": true}', F.MALFORMED_FRAME),
    ('{"type": "credit", "op": "a", "credits": "5"}', F.MALFORMED_FRAME),
    ('{"type": "credit", "op": "a", "credits": 0}', F.MALFORMED_FRAME),
    ('{"type": "cancel", "op": 7}', F.MALFORMED_FRAME),
    ('{"type": "open"}', F.MALFORMED_FRAME),
    ("x" * (MAX + 1), F.FRAME_TOO_LARGE),
    (b"\x00" * (MAX + 1), F.FRAME_TOO_LARGE),
])
def test_bad_frames_are_typed_errors(data: str | bytes, code: str) -> None:
    with pytest.raises(F.FrameError) as info:
        F.decode(data, max_bytes=MAX)
    assert info.value.code == code
    frame = info.value.frame()
    assert frame["type"] == "error" and frame["code"] == code and isinstance(frame["message"], str)


def test_error_carries_the_op_when_readable() -> None:
    with pytest.raises(F.FrameError) as info:
        F.decode('{"type": "credit", "op": "op-1", "credits": -1}', max_bytes=MAX)
    assert info.value.op == "op-1" and info.value.frame_type == "credit"


def test_multibyte_text_is_measured_in_bytes() -> None:
    text = json.dumps({"type": "ping", "nonce": "é" * (MAX // 2)}, ensure_ascii=False)
    assert len(text) < MAX
    with pytest.raises(F.FrameError) as info:
        F.decode(text, max_bytes=MAX)
    assert info.value.code == F.FRAME_TOO_LARGE


def test_encoding_pick_follows_the_client_order() -> None:
    assert F.pick_encoding(["msgpack", "json"]) == "msgpack"
    assert F.pick_encoding(["cbor", "json"]) == "json"
    assert F.pick_encoding(["cbor"]) is None


def test_server_frames_round_trip_in_both_encodings() -> None:
    frame = F.result("op", 4, {"type": "response.output_text.delta", "choice_index": 0, "delta": "hi"})
    for enc in F.ENCODINGS:
        data = F.encode(frame, enc)
        assert isinstance(data, str if enc == "json" else bytes)
        assert F.decode_server(data) == frame


def test_random_bytes_only_ever_raise_frame_errors() -> None:
    rng = random.Random(7)
    good = [json.dumps({"type": t, "op": "a", "credits": 1, "envelope": {}, "schema_version": "s"})
            for t in F.CLIENT_FRAMES]
    for _ in range(3000):
        pick = rng.random()
        data: str | bytes
        if pick < 0.3:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        elif pick < 0.6:
            g = rng.choice(good)
            data = g[: rng.randint(0, len(g))]
        else:
            value = rng.choice([None, True, -1, 2**40, "x", [], {}, 1.5])
            obj = json.loads(rng.choice(good))
            obj[rng.choice(list(obj))] = value
            data = msgspec.msgpack.encode(obj) if rng.random() < 0.5 else json.dumps(obj)
        try:
            F.decode(data, max_bytes=MAX)
        except F.FrameError as exc:
            assert exc.code in F.ERROR_CODES


def test_spec_document_names_every_frame_code_and_close_code() -> None:
    """docs/nnrp.md is what other clients are built from: every code here must be specified there."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "nnrp.md").read_text()
    names = [*F.ERROR_CODES, *F.CLIENT_FRAMES, "welcome", "opened", "result", "error"]
    assert [n for n in names if f'"type": "{n}"' not in doc and f"`{n}`" not in doc] == []
    codes = [F.CLOSE_NORMAL, F.CLOSE_RESTART, F.CLOSE_TOO_BIG, F.CLOSE_INTERNAL, F.CLOSE_UNAUTHORIZED,
             F.CLOSE_IDLE]
    assert [c for c in codes if f"| {c} |" not in doc] == []
