"""One config tree from YAML with environment overrides."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from coordinator.config import load_settings


def test_yaml_then_environment_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "render: {url: 'http://render:8100', timeout_s: 2}\n"
        "engines: [{url: 'http://e1:8200'}, {url: 'http://e2:8200', role: decode}]\n"
        "models: [{name: m1, aliases: [gpt-4o-mini]}]\n"
    )
    monkeypatch.setenv("COORD_RENDER__TIMEOUT_S", "7.5")
    s = load_settings(cfg)
    assert s.render.url == "http://render:8100"
    assert s.render.timeout_s == 7.5
    assert [e.role for e in s.engines] == ["union", "decode"]
    assert s.models[0].aliases == ["gpt-4o-mini"]


def test_duplicate_alias_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COORD_CONFIG", raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("models: [{name: a, aliases: [x]}, {name: b, aliases: [x]}]\n")
    with pytest.raises(ValidationError, match="configured twice"):
        load_settings(cfg)


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rendr: {url: x}\n")
    with pytest.raises(ValidationError):
        load_settings(cfg)


def test_handoff_and_trigger_engines_of_one_model_are_refused_at_start() -> None:
    engines = [{"url": "http://p:8000", "role": "prefill", "pd_protocol": "trigger"},
               {"url": "http://d:8000", "role": "decode"}]
    with pytest.raises(ValidationError) as err:
        load_settings(engines=engines)
    message = str(err.value)
    assert "mixes handoff and trigger" in message
    assert "http://p:8000 (trigger)" in message and "http://d:8000 (handoff)" in message
    ok = load_settings(engines=[{**e, "pd_protocol": "trigger"} for e in engines])
    assert ok.uses_trigger()
    assert not load_settings(engines=[{"url": "http://u:8000", "pd_protocol": "trigger"}]).uses_trigger()


def test_a_discovered_service_counts_in_the_one_protocol_rule() -> None:
    with pytest.raises(ValidationError, match=r"discovery decode\.svc"):
        load_settings(engines=[{"url": "http://p:8000", "role": "prefill", "pd_protocol": "trigger"}],
                      discovery=[{"dns_name": "decode.svc", "role": "decode"}])


def test_a_wildcard_metaserver_needs_an_address_engines_can_reach() -> None:
    with pytest.raises(ValidationError, match="advertise_host"):
        load_settings(topology={"trigger": {"host": "0.0.0.0"}})
    s = load_settings(topology={"trigger": {"host": "0.0.0.0", "advertise_host": "10.1.2.3"}})
    assert s.topology.trigger.advertise_host == "10.1.2.3"


def test_render_off_needs_an_engine_that_answers_on_its_own_api(tmp_path: Path) -> None:
    """``render.enable: false`` sends every request to an engine's OpenAI API: a fleet of token-only
    engines could answer none, and obfuscation would hand the engines plain text. The coordinator
    refuses to start with either."""
    from coordinator.app import build_components

    off = load_settings(render={"enable": False}, engines=[{"url": "http://e:8000", "native_api": False}])
    assert "native_api" in (off.render_off_problem() or "")
    learned = load_settings(render={"enable": False}, engines=[{"url": "http://e:8000"}])
    assert learned.render_off_problem() is None   # unset: learned from the engine when it starts
    with pytest.raises(ValueError, match="native_api"):
        build_components(off)
    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    hidden = load_settings(render={"enable": False}, engines=[{"url": "http://e:8000", "native_api": True}],
                           obfuscation={"enabled": True, "key_file": str(key)})
    assert "obfuscation" in (hidden.render_off_problem() or "")
    ok = load_settings(render={"enable": False}, engines=[{"url": "http://e:8000", "native_api": True}])
    assert ok.render_off_problem() is None
