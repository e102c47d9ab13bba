"""A protocol-exact simulated vLLM 0.32 `--tokens-only` engine (no vLLM needed).

`build_app(SimConfig(...))` gives the FastAPI app; `SimulatedEngine` runs it on a free port for tests;
`python -m token_engine.simulator` serves it from the command line; `wire_shape` compares wire objects.
"""

from .app import build_app
from .config import SimConfig
from .faults import SimFaults
from .prefix_cache import PrefixCache
from .server import SimulatedEngine
from .wire import wire_diff, wire_shape

__all__ = ["PrefixCache", "SimConfig", "SimFaults", "SimulatedEngine", "build_app", "wire_diff", "wire_shape"]
