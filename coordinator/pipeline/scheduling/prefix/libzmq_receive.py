"""Reading a KV-event feed through libzmq (``scheduling.prefix.reader: libzmq``, and the endpoints our
own ZMTP reader does not speak): libzmq's functions handed to ``_mirror.drain``, and the Python
receive that frames a message as vLLM sends it. ``feeds.KvEventSubscriber`` drives both.
"""

from __future__ import annotations

import ctypes
import sys
from typing import cast

import zmq

from coordinator.pipeline.scheduling.prefix import kv_events

# pyzmq's ``Socket.get`` wraps ``EVENTS`` in an enum and ``recv_multipart`` asks ``RCVMORE`` after every
# frame; at 256 engines (2,560 messages a second) those wrappers cost more than decoding the batches.
# The backend's own ``get`` skips the first (docs/scheduling.md, "The pod's KV index").
_get = zmq.backend.Socket.get
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


_LIBZMQ_FUNCTIONS = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_data", "zmq_msg_size", "zmq_msg_more",
                     "zmq_msg_close", "zmq_getsockopt", "zmq_errno")


def _bind_native_drain() -> bool:
    """Hand ``_mirror.drain`` the functions of the libzmq that pyzmq's backend uses, so that it receives
    without pyzmq's objects. Looked up through the backend's own extension module: a symbol is searched
    in that module and the libraries it links, so this is the libzmq its sockets belong to even if
    another one is loaded (pyzmq's wheels bundle their own). False (the feeds receive in Python)
    without the extension, for a libzmq outside 4.2-4.x (``zmq_msg_t``'s size), or for a backend that
    does not expose them (CFFI, a static build)."""
    if not kv_events.NATIVE_MIRROR or not (4, 2) <= zmq.zmq_version_info() < (5, 0):
        return False
    try:
        lib = ctypes.CDLL(sys.modules[zmq.backend.Socket.__module__].__file__ or "")
        return kv_events.bind_libzmq([ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
                                      for name in _LIBZMQ_FUNCTIONS])
    except (OSError, KeyError, AttributeError, TypeError, ValueError):
        return False


NATIVE_DRAIN = _bind_native_drain()
"""Whether feeds receive and apply their batches in C (``_mirror.drain``), Python handling the rest."""


def receive(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One message, read as vLLM sends it (three frames: topic, sequence number, payload), asking
    whether more follow only after the third. A message of more frames is read whole (``handle``
    counts it as bad); one of fewer takes the next message's first frames with it, and the check
    realigns on the message after (both are counted, and the sequence check sees the loss)."""
    frames = [sock.recv(_NOBLOCK)]   # ``zmq.Again``: nothing is waiting
    try:
        frames.append(sock.recv(_NOBLOCK))
        last = sock.recv(_NOBLOCK, copy=False)
    except zmq.Again:   # a message of fewer frames, and nothing after it
        return frames
    frames.append(last.bytes)
    more = last.more
    while more:
        last = sock.recv(_NOBLOCK, copy=False)
        frames.append(last.bytes)
        more = last.more
    return frames


def more_waiting(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits. Reading ``EVENTS`` rather than receiving until ``zmq.Again``: the
    exception costs twice as much, and reading ``EVENTS`` re-arms ZMQ's edge-triggered descriptor."""
    return bool(cast(int, _get(sock, _EVENTS)) & _POLLIN)
