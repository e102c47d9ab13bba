"""The request's path without HTTP: render → admission → scheduling → engines → derender.

What the doors above may take from here is the request runner (``service``), the request's
vocabulary (``context``, ``errors``), the model list (``catalog``) and the chat form other APIs
convert to (``chat_form``); the subpackages declare their own faces, and the operator doors reach a
few more (tests/unit/test_layering.py lists them).
"""

__all__ = ["catalog", "chat_form", "context", "errors", "service"]
