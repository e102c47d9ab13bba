"""The local stack starts exactly the render sidecars its coordinator config lists (the Kubernetes pod's
sidecars are checked against its config by ``deploy.manifests``, tests/unit/test_manifests.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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
