"""The shipped deployments start exactly the render sidecars their coordinator config lists."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from coordinator.config import Settings
from deploy.local_stack import load_plan

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def settings_of(data: dict[str, Any]) -> Settings:
    os.environ.pop("COORD_CONFIG", None)
    return Settings(**data)


def test_local_stack_starts_one_sidecar_per_listed_url(tmp_path: Path) -> None:
    shipped = DEPLOY / "local" / "coordinator.yaml"
    urls = settings_of(yaml.safe_load(shipped.read_text())).render.endpoints
    assert [f"http://{h}:{p}" for h, p in load_plan(shipped).renders] == urls
    path = tmp_path / "c.yaml"
    path.write_text("render: {urls: ['http://127.0.0.1:9100', 'http://127.0.0.1:9101', 'http://127.0.0.1:9102']}\n"
                    "engines: [{url: 'http://127.0.0.1:9200'}]\n")
    assert [p for _, p in load_plan(path).renders] == [9100, 9101, 9102]


def test_local_stack_with_a_single_url_starts_one_sidecar(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("render: {url: 'http://127.0.0.1:9100'}\nengines: [{url: 'http://127.0.0.1:9200'}]\n")
    assert load_plan(path).renders == (("127.0.0.1", 9100),)


def test_k8s_pod_runs_a_render_container_for_every_listed_sidecar() -> None:
    config_map, deployment, *_ = yaml.safe_load_all((DEPLOY / "k8s" / "coordinator.yaml").read_text())
    urls = settings_of(yaml.safe_load(config_map["data"]["coordinator.yaml"])).render.endpoints
    containers = deployment["spec"]["template"]["spec"]["containers"]
    renders = [c for c in containers if c["name"].startswith("render")]
    ports = [int(c["args"][c["args"].index("--port") + 1]) for c in renders]
    assert sorted(urlsplit(u).port for u in urls) == sorted(ports) and len(ports) >= 2
    for c, port in zip(renders, ports, strict=True):
        assert c["readinessProbe"]["httpGet"]["port"] == port
