"""Derender: the engines' token ids back into the client's text, batch and streaming.

The pipeline meets this package through ``Derender`` (``stage.py``) and the names below, plus
``echo`` (the prompt written into an answer) and ``fixups`` (native's rules, render widens a
completion's logprobs by one); the rest are its rooms: the
sidecar client (``client.py``), one prompt's stream (``stream.py``), a request's merged streams
(``session.py``), native's fix-ups around a batch call (``batch.py``, ``fixups.py``), stop strings,
echo, and what the sidecar can do (``features.py``).
"""

from coordinator.pipeline.derender.client import Derenderer, request_view
from coordinator.pipeline.derender.session import StreamSession
from coordinator.pipeline.derender.stage import Derender
from coordinator.pipeline.derender.stream import Coalescing

__all__ = ["Coalescing", "Derender", "Derenderer", "StreamSession", "echo", "fixups", "request_view"]
