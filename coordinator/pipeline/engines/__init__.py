"""The engines: who they are (``engine``, ``registry``, ``capabilities``), how to call them (``client``
for the token route, ``native`` for their own OpenAI API, ``http_errors`` for what their answers
mean), when to stop calling one (``breaker``), which LoRA adapters each holds (``adapters``) and
loading them (``lora``). ``obfuscating`` is chosen by ``app.py``.
"""

__all__ = ["adapters", "breaker", "capabilities", "client", "engine", "http_errors", "lora", "native",
           "registry"]
