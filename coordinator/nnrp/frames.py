"""NNRP wire protocol v1: frame types, the JSON and msgpack codecs, and validation.

A frame is one WebSocket message holding one object with a ``type`` member. Text messages are JSON,
binary messages msgpack; the server decodes either kind in every state and sends the encoding the
hello negotiated. Decoding never raises anything but ``FrameError``, whose ``code`` is what the error
frame says, so a session can answer any input with an error frame and go on (``docs/nnrp.md``).

Client frames are validated into frozen ``msgspec`` structs (strict types: ``true`` is not a number,
``"5"`` is not a count). Server frames are built as plain dicts by the helpers below: one is made per
streamed event, and a dict goes straight to the encoder.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

VERSION: Final = 1
ENCODINGS: Final = ("json", "msgpack")  # the server's preference when the client lists both first-equal

# Close codes (WebSocket close frame). 1000/1001/1009/1011 have their RFC 6455 meaning.
CLOSE_NORMAL: Final = 1000          # after the client's close frame
CLOSE_RESTART: Final = 1012         # the server restarts or shuts down (sent by the WebSocket layer)
CLOSE_GOING_AWAY: Final = 1001      # the server drains: after the session's operations (docs/shutdown.md)
CLOSE_TOO_BIG: Final = 1009         # a message above the transport's hard limit (the server's, 16 MiB)
CLOSE_INTERNAL: Final = 1011        # the session failed unexpectedly
CLOSE_UNAUTHORIZED: Final = 4401    # open carried no valid API key
CLOSE_IDLE: Final = 4408            # no frame from the client for idle_timeout_s

# Error frame codes.
MALFORMED_FRAME: Final = "malformed_frame"            # not JSON/msgpack, not an object, bad member
UNKNOWN_TYPE: Final = "unknown_type"                  # ``type`` missing or not a frame type
FRAME_TOO_LARGE: Final = "frame_too_large"            # above max_frame_bytes
UNEXPECTED_FRAME: Final = "unexpected_frame"          # not allowed in the session's state
UNSUPPORTED_VERSION: Final = "unsupported_version"    # hello lists no protocol version we speak
NO_COMMON_ENCODING: Final = "no_common_encoding"      # hello lists no encoding we speak
UNSUPPORTED_SCHEMA_VERSION: Final = "unsupported_schema_version"  # open: another profile/schema
UNAUTHORIZED: Final = "unauthorized"                  # open: bad API key (then close 4401)
DUPLICATE_OPERATION: Final = "duplicate_operation"    # submit: the id names an open operation
UNKNOWN_OPERATION: Final = "unknown_operation"        # cancel/credit/diagnostics: no such open operation
TOO_MANY_OPERATIONS: Final = "too_many_operations"    # submit beyond max_operations
ERROR_CODES: Final = frozenset({MALFORMED_FRAME, UNKNOWN_TYPE, FRAME_TOO_LARGE, UNEXPECTED_FRAME,
                                UNSUPPORTED_VERSION, NO_COMMON_ENCODING, UNSUPPORTED_SCHEMA_VERSION,
                                UNAUTHORIZED, DUPLICATE_OPERATION, UNKNOWN_OPERATION, TOO_MANY_OPERATIONS})

MAX_CREDITS: Final = 2**31 - 1
OpId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Credits = Annotated[int, msgspec.Meta(ge=0, le=MAX_CREDITS)]
Grant = Annotated[int, msgspec.Meta(ge=1, le=MAX_CREDITS)]
Reason = Annotated[str, msgspec.Meta(max_length=1024)]
Short = Annotated[str, msgspec.Meta(max_length=256)]
Nonce = str | int | None


class FrameError(Exception):
    """A client frame the session refuses; becomes ``{"type": "error", "code": …}``."""

    def __init__(self, code: str, message: str, *, op: str | None = None,
                 frame_type: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.op = op
        self.frame_type = frame_type

    def frame(self) -> dict[str, Any]:
        return error(self.code, self.message, op=self.op, frame_type=self.frame_type)


# --------------------------------------------------------------------------------------------------
# Client → server frames
# --------------------------------------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True):
    versions: list[int] = msgspec.field(default_factory=lambda: [VERSION])
    encodings: list[Short] = msgspec.field(default_factory=lambda: ["json"])
    client: Short | None = None  # free-form client name/version, for logs


class Open(msgspec.Struct, frozen=True):
    schema_version: Short
    profile: Short | None = None
    authorization: Annotated[str, msgspec.Meta(max_length=4096)] | None = None  # "Bearer <key>"


class Submit(msgspec.Struct, frozen=True):
    op: OpId
    envelope: Any  # validated by the profile, so its errors are response.error events, not frames
    credits: Credits | None = None  # this operation's first credits; default the session's initial


class Cancel(msgspec.Struct, frozen=True):
    op: OpId
    reason: Reason = "cancelled by client"


class Credit(msgspec.Struct, frozen=True):
    op: OpId
    credits: Grant


class DiagnosticsRequest(msgspec.Struct, frozen=True):
    op: OpId | None = None


class Ping(msgspec.Struct, frozen=True):
    nonce: Nonce = None


class Pong(msgspec.Struct, frozen=True):
    nonce: Nonce = None


class Close(msgspec.Struct, frozen=True):
    reason: Reason = ""


ClientFrame = Hello | Open | Submit | Cancel | Credit | DiagnosticsRequest | Ping | Pong | Close
CLIENT_FRAMES: Final[dict[str, type[ClientFrame]]] = {
    "hello": Hello, "open": Open, "submit": Submit, "cancel": Cancel, "credit": Credit,
    "diagnostics": DiagnosticsRequest, "ping": Ping, "pong": Pong, "close": Close,
}

_json_decoder = msgspec.json.Decoder()
_msgpack_decoder = msgspec.msgpack.Decoder()
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def decode(data: str | bytes, *, max_bytes: int) -> ClientFrame:
    """One client message → a validated frame. Text is JSON, bytes are msgpack.

    Order: size, syntax, an object, a known ``type``, then the frame's members. The op id is put on
    the error when it could be read, so a refused submit can be matched to its operation."""
    size = len(data.encode()) if isinstance(data, str) and len(data) * 4 > max_bytes else len(data)
    if size > max_bytes:
        raise FrameError(FRAME_TOO_LARGE, f"frame of {size} bytes is above max_frame_bytes ({max_bytes})")
    try:
        raw = _json_decoder.decode(data) if isinstance(data, str) else _msgpack_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        kind = "JSON" if isinstance(data, str) else "msgpack"
        raise FrameError(MALFORMED_FRAME, f"not valid {kind}: {exc}") from None
    if not isinstance(raw, dict):
        raise FrameError(MALFORMED_FRAME, "a frame must be an object")
    kind_name = raw.get("type")
    cls = CLIENT_FRAMES.get(kind_name) if isinstance(kind_name, str) else None
    op = raw.get("op")
    op = op if isinstance(op, str) and 0 < len(op) <= 128 else None
    if cls is None:
        raise FrameError(UNKNOWN_TYPE, f"unknown frame type {kind_name!r}"[:300], op=op)
    fields = {k: v for k, v in raw.items() if k != "type"}
    try:
        return msgspec.convert(fields, type=cls)
    except msgspec.ValidationError as exc:
        raise FrameError(MALFORMED_FRAME, f"{kind_name}: {exc}", op=op, frame_type=kind_name) from None


def frame_type(frame: ClientFrame) -> str:
    return _TYPE_NAMES[type(frame)]


_TYPE_NAMES: Final[dict[type, str]] = {cls: name for name, cls in CLIENT_FRAMES.items()}


def encode(frame: dict[str, Any], encoding: str) -> str | bytes:
    """A server frame in the session's encoding: JSON text or msgpack bytes."""
    if encoding == "msgpack":
        return _msgpack_encoder.encode(frame)
    return _json_encoder.encode(frame).decode()


def encode_client(frame: dict[str, Any], encoding: str) -> str | bytes:
    """A client frame (the client library's side): same codecs."""
    return encode(frame, encoding)


def decode_server(data: str | bytes) -> dict[str, Any]:
    """A server frame (the client library's side). Raises ``FrameError`` on anything else."""
    try:
        raw = _json_decoder.decode(data) if isinstance(data, str) else _msgpack_decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError) as exc:
        raise FrameError(MALFORMED_FRAME, f"server sent an undecodable frame: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise FrameError(MALFORMED_FRAME, "server frame is not an object with a type")
    return raw


def pick_encoding(offered: list[str]) -> str | None:
    """The first encoding in the client's order of preference that the server speaks."""
    return next((e for e in offered if e in ENCODINGS), None)


# --------------------------------------------------------------------------------------------------
# Server → client frames
# --------------------------------------------------------------------------------------------------


def welcome(session_id: str, encoding: str, *, heartbeat_s: float, idle_timeout_s: float,
            max_frame_bytes: int, initial_credits: int, max_operations: int) -> dict[str, Any]:
    return {"type": "welcome", "version": VERSION, "encoding": encoding, "session_id": session_id,
            "heartbeat_s": heartbeat_s, "idle_timeout_s": idle_timeout_s, "max_frame_bytes": max_frame_bytes,
            "initial_credits": initial_credits, "max_operations": max_operations}


def opened(session_id: str, manifest: dict[str, Any]) -> dict[str, Any]:
    return {"type": "opened", "session_id": session_id, "profile": manifest["profile"],
            "schema_version": manifest["schema_version"], "manifest": manifest}


def result(op: str, seq: int, event: dict[str, Any] | Any) -> dict[str, Any]:
    return {"type": "result", "op": op, "seq": seq, "event": event}


def error(code: str, message: str, *, op: str | None = None, frame_type: str | None = None) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "op": op, "frame_type": frame_type}


def diagnostics(kind: Literal["snapshot", "summary"], record: dict[str, Any], *,
                op: str | None = None) -> dict[str, Any]:
    return {"type": "diagnostics", "kind": kind, "op": op, "record": record}


def ping(nonce: Nonce = None) -> dict[str, Any]:
    return {"type": "ping", "nonce": nonce}


def pong(nonce: Nonce = None) -> dict[str, Any]:
    return {"type": "pong", "nonce": nonce}
