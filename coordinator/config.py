"""One configuration tree for the coordinator.

Loaded from a YAML file (``--config PATH`` or ``COORD_CONFIG``) with environment overrides
(``COORD_<SECTION>__<FIELD>``, e.g. ``COORD_RENDER__URL``). Environment wins over YAML so a
Kubernetes manifest can patch one value without templating the whole file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

EngineRole = Literal["union", "prefill", "decode"]


class ServerSettings(BaseModel):
    """Where the coordinator listens and how it treats clients."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[SecretStr] = Field(
        default_factory=list, description="Bearer keys accepted from clients; empty = no auth"
    )
    request_mode: Literal["strict", "compat"] = Field(
        default="strict",
        description="strict: unsupported request fields are a 400; compat: they are ignored and logged",
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    metrics: bool = Field(default=True, description="serve Prometheus metrics on /metrics")
    log_level: str = "info"


class RenderSettings(BaseModel):
    """The localhost vLLM render sidecar (render + derender)."""

    url: str = "http://127.0.0.1:8100"
    timeout_s: float = Field(default=5.0, gt=0, description="per render/derender call, not per stream")
    max_connections: int = Field(default=128, ge=1)
    workers: int = Field(default=4, ge=1, description="--renderer-num-workers for the sidecar (deploy only)")
    parsers: bool = Field(
        default=False,
        description="the sidecar runs a tool-call or reasoning parser (derender then needs the full prompt "
        "ids on every streamed chunk)",
    )


class EngineSettings(BaseModel):
    """One token-only engine (`/inference/v1/generate`)."""

    url: str
    role: EngineRole = "union"
    model: str | None = Field(default=None, description="served model name; None = any configured model")
    weight: float = Field(default=1.0, gt=0)


class ModelSettings(BaseModel):
    """A model clients may ask for: its served name (as render knows it) and aliases."""

    name: str
    aliases: list[str] = Field(default_factory=list)
    max_model_len: int | None = Field(
        default=None, ge=1, description="None = read from the render sidecar's /v1/models"
    )


class EngineClientSettings(BaseModel):
    """Timeouts and pool sizes towards the engines."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    stream_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="max silence on a generate stream (engine queueing included)"
    )
    total_timeout_s: float = Field(default=1800.0, gt=0, description="non-streaming generate as a whole")
    max_connections: int = Field(default=512, ge=1)
    health_interval_s: float = Field(default=5.0, gt=0)


class StreamSettings(BaseModel):
    """The per-request streaming path."""

    queue_chunks: int = Field(
        default=32, ge=1, description="chunks buffered between engine reader and client writer"
    )


class Settings(BaseSettings):
    """Root of the configuration tree."""

    model_config = SettingsConfigDict(
        env_prefix="COORD_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    server: ServerSettings = Field(default_factory=ServerSettings)
    render: RenderSettings = Field(default_factory=RenderSettings)
    engine_client: EngineClientSettings = Field(default_factory=EngineClientSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    engines: list[EngineSettings] = Field(
        default_factory=lambda: [EngineSettings(url="http://127.0.0.1:8200")]
    )
    models: list[ModelSettings] = Field(
        default_factory=lambda: [ModelSettings(name="smollm2-135m-instruct", aliases=["gpt-4o-mini"])]
    )

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelSettings]) -> list[ModelSettings]:
        seen: set[str] = set()
        for m in models:
            for name in (m.name, *m.aliases):
                if name in seen:
                    raise ValueError(f"model name or alias {name!r} is configured twice")
                seen.add(name)
        return models

    @model_validator(mode="after")
    def _engines_known(self) -> Settings:
        names = {m.name for m in self.models}
        for e in self.engines:
            if e.model is not None and e.model not in names:
                raise ValueError(f"engine {e.url} serves {e.model!r}, which is not in models")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get("COORD_CONFIG")
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the tree from (in rising priority) defaults, the YAML file, the environment, ``overrides``."""
    if path is not None:
        os.environ["COORD_CONFIG"] = str(path)
    return Settings(**overrides)
