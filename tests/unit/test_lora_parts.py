"""The LoRA parts on their own: what an engine holds and may give up, what its metrics say, how the
lora scorer ranks engines, how the catalog names adapters, which adapter paths config accepts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.config import ModelSettings, Settings, TenantLimits
from coordinator.pipeline.admission.tenants import Tenant
from coordinator.pipeline.catalog import ModelCatalog
from coordinator.pipeline.engines.adapters import Residency
from coordinator.pipeline.engines.telemetry import Telemetry, parse_metrics
from coordinator.pipeline.errors import BadRequest, ModelNotFound
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.scheduling.scorers import LoraScorer
from coordinator.pipeline.scheduling.types import ScoringInput


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_least_recently_used_idle_adapter_is_the_one_to_go() -> None:
    r = Residency(default_capacity=3, clock=Clock())
    for name in ("a", "b", "c"):
        r.loaded(name)
    r.touch("a")                      # a used most recently: b is now the oldest
    assert r.evictable() == "b"
    r.pinned.add("b")
    assert r.evictable() == "c", "a pinned adapter never goes"
    r.begin("c")
    assert r.evictable() == "a", "an adapter with a request running never goes"
    r.begin("a")
    assert r.evictable() is None
    r.end("a")
    assert r.evictable() == "a" and r.free_slots == 0


def test_the_engines_own_list_replaces_what_the_coordinator_believed() -> None:
    r = Residency(clock=Clock())
    r.loaded("mine")
    came, went = r.learn(["by-hand"], capacity=2)
    assert (came, went) == ({"by-hand"}, {"mine"}) and set(r.held) == {"by-hand"}
    assert r.capacity == 2 and r.learned_capacity == 2
    r.loaded("new")
    assert r.evictable() == "by-hand", "an adapter loaded by hand and never used goes first"
    r.configured_capacity = 5
    assert r.capacity == 5, "engines[].max_loras wins over what the engine says"
    r.forget()
    assert not r.held and r.learned_capacity is None


def test_lora_requests_info_is_read_from_its_newest_label_set() -> None:
    """vLLM keeps one gauge per label set, set to the time it was reported: the newest is now."""
    text = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a1,a2",waiting_lora_adapters="a3"} 1.8e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.75e9
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
"""
    t = parse_metrics(text)
    assert (t.max_loras, t.running_adapters, t.waiting_adapters, t.waiting) == (2, ("a1", "a2"), ("a3",), 1)
    assert parse_metrics("vllm:num_requests_waiting 0\n").max_loras is None, "LoRA off: nothing learned"


@dataclass
class View:
    url: str
    adapters: Residency
    model: str | None = None
    inflight_tokens: int = 0
    token_budget: int = 1000
    telemetry: Telemetry = field(default_factory=Telemetry)

    def can_all(self, needs: Any) -> bool:
        return True


def test_the_lora_scorer_ranks_holders_then_room_then_evictable_then_full() -> None:
    def engine(url: str, *held: str, capacity: int = 2, running: tuple[str, ...] = ()) -> View:
        r = Residency(default_capacity=capacity, clock=Clock())
        for name in held:
            r.loaded(name)
        for name in running:
            r.begin(name)
        return View(url, r)

    engines = [engine("holds", "x"), engine("room"), engine("evict", "p", "q", capacity=2),
               engine("full", "p", "q", capacity=2, running=("p", "q")),
               engine("hot", "x", running=("x",) * 3)]
    req = SchedRequest("r", "m", [1, 2, 3], 4, lora="x")
    scores = LoraScorer(replicate_inflight=3)(ScoringInput(req, {}, 16), engines)
    assert scores == [1.0, 0.5, 0.25, 0.0, 0.5]
    base = SchedRequest("r", "m", [1, 2, 3], 4)
    assert LoraScorer()(ScoringInput(base, {}, 16), engines) == [0.0] * 5, "neutral for the base model"
    # Every holder hot and another engine could load it: the others rank as holders, the holder low.
    hot_only = [engines[4], engines[1], engines[2], engines[3]]
    assert LoraScorer(replicate_inflight=3)(ScoringInput(req, {}, 16), hot_only) == [0.25, 1.0, 0.5, 0.0]
    assert LoraScorer(replicate_inflight=3)(ScoringInput(req, {}, 16), [engines[4], engines[3]]) == [0.5, 0.0], \
        "nowhere to spread: the hot holder keeps it"


def test_an_adapter_is_a_model_of_its_own_in_the_catalog() -> None:
    catalog = ModelCatalog([ModelSettings(name="base", aliases=["b"],
                                          adapters=[{"name": "ft", "path": "/adapters/ft"}])], None)
    assert catalog.resolve_named("ft")[1] == "ft" and catalog.resolve_named("ft")[0].name == "base"
    assert catalog.resolve_named("b")[1] is None and catalog.resolve_named("base")[1] is None
    cards = {c["id"]: c for c in catalog.model_list()["data"]}
    assert (cards["ft"]["parent"], cards["ft"]["root"]) == ("base", "/adapters/ft")
    with pytest.raises(ModelNotFound):
        catalog.resolve("gone")
    added = catalog.add_adapter("base", "ft2", "/adapters/ft2")
    assert catalog.adapter("ft2") == added and catalog.add_adapter("base", "ft2", "/adapters/ft2") == added
    with pytest.raises(BadRequest):
        catalog.add_adapter("base", "b", "/adapters/x")        # an alias's name
    with pytest.raises(BadRequest):
        catalog.add_adapter("base", "ft2", "/elsewhere")       # the same name from another path
    with pytest.raises(BadRequest):
        catalog.add_adapter("nope", "ft3", "/adapters/ft3")


def test_adapter_paths_must_lie_under_the_allowed_roots() -> None:
    def settings(path: str) -> Settings:
        return Settings(lora={"allowed_roots": ["/srv/adapters"]},
                        models=[{"name": "m", "adapters": [{"name": "a", "path": path}]}])

    assert settings("/srv/adapters/a").adapter_path_problem("/srv/adapters/x/y") is None
    for bad in ("/srv/adapters/../etc", "/srv/adapters-evil/a", "relative/a", "/etc/passwd"):
        with pytest.raises(ValidationError, match="outside the allowed adapter roots"):
            settings(bad)
    with pytest.raises(ValidationError, match="configured twice"):
        Settings(models=[{"name": "m", "aliases": ["a"], "adapters": [{"name": "a", "path": "/x"}]}])


def test_a_tenant_may_be_held_to_some_adapters() -> None:
    limited = Tenant.of("t", TenantLimits(adapters=["ok"]))
    assert limited.may_use("ok") and limited.may_use(None) and not limited.may_use("other")
    assert Tenant.of("u", TenantLimits()).may_use("anything")
