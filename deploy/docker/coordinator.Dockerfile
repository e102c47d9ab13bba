# syntax=docker/dockerfile:1
# The coordinator image: FastAPI, httpx, pydantic and the coordinator package. No vLLM: rendering and
# inference run in other containers (render.Dockerfile next to it in the pod, engines in their own
# pods), and the coordinator only talks HTTP/ZMQ to them, so the image stays small (~200 MB).
#
# Build from the repository root (the context needs pyproject.toml, README.md and coordinator/):
#   docker build -f deploy/docker/coordinator.Dockerfile -t llm-coordinator:0.1.0 .
#   docker build -f deploy/docker/coordinator.Dockerfile --build-arg EXTRAS= -t llm-coordinator:0.1.0-bare .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Build a wheel in a throw-away stage, so the source tree and build tools stay out of the image.
FROM ${PYTHON_IMAGE} AS build
# gcc: the block-hash chain's C extension (coordinator/contracts/_chain.c), built into the wheel; only
# this stage has a compiler. Debian stable's versions are the ones wanted.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="llm-coordinator" \
      org.opencontainers.image.description="OpenAI-compatible coordinator in front of token-only vLLM engines"
# Extras, comma-separated: local-tokenizer (transformers without torch: the render fallback and the
# native chain size requests with it when every render sidecar is down; on by default, since the
# overlays' engines serve their own API), tracing (OpenTelemetry). Empty: the bare coordinator.
ARG EXTRAS="local-tokenizer"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1
COPY --from=build /wheels /wheels
# The wheel is this project's own, named by its path: there is no version to pin beyond it.
# hadolint ignore=DL3013
RUN set -eu; wheel="$(echo /wheels/llm_coordinator-*.whl)"; \
    pip install --no-cache-dir "${wheel}${EXTRAS:+[${EXTRAS}]}"; \
    rm -rf /wheels; \
    useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin coordinator
# A numeric user, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# Docker/compose only (Kubernetes uses the pod's probes). /health is liveness: the process answers;
# /ready (render and an engine reachable) would mark a healthy coordinator bad while engines start.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
ENTRYPOINT ["python", "-m", "coordinator"]
# The config file decides the rest; a container must listen beyond its own loopback.
CMD ["--host", "0.0.0.0"]
