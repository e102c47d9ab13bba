"""Build a small vision-language model that vLLM serves on CPU, without a model hub.

What it is: an Idefics3 model (the architecture of SmolVLM) made of a tiny SigLIP-style vision tower
(2 layers, width 64, 128x128 images in 16x16 patches, deterministic random weights from a fixed
seed), Idefics3's pixel-shuffle connector (scale 2: 16 embeddings an image) and the SmolLM2-135M
language model of ``model_prep`` with its tokenizer, to which the four image tokens Idefics3 uses
are added. Its answers about an image are gibberish, but deterministic and different for different
images, which is all an A/B of the coordinator against native vLLM needs.

Why Idefics3: vLLM 0.32's LLaVA, LLaVA-NeXT, Qwen-VL, InternVL and Gemma 3 modules import
torchvision, and PyPI's torchvision does not load against the CPU torch vLLM runs on here
(``docs/running-vllm-on-cpu.md``); Idefics3 needs only PIL and takes a Llama language model, so the
text model we already build is reused. Its placeholders hold non-embedding tokens, which is also the
case that vLLM 0.32's render → generate path gets wrong (``render_sidecar/mm_placeholders.py``).

The folder is built beside its final place and renamed in only after vLLM's config loader accepted it
and the marker was written, like ``model_prep``. ``python -m token_engine.vision_prep`` prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from token_engine.model_prep import (
    Log,
    ModelPrepError,
    _built_beside,
    _locked_file,
    _log,
    _step,
    ensure_model,
    is_prepared,
    resolve_cache_dir,
    write_marker,
)

VISION_DIR_NAME = "SmolVLM-tiny"
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
IMAGE_SIZE = 128
PATCH_SIZE = 16
SCALE_FACTOR = 2
SEED = 0
RECIPE = f"idefics3 vision={IMAGE_SIZE}/{PATCH_SIZE}x2x64 scale={SCALE_FACTOR} seed={SEED} over SmolLM2-135M"


def image_seq_len() -> int:
    """Embeddings (``<image>`` tokens) of one image: its patches, pixel-shuffled by the scale factor."""
    return (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2


def build(text_model: Path, out: Path, log: Log = _log) -> None:
    """Write the model folder to ``out`` (the slow imports happen here only)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaForCausalLM,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    with _step("Loading the SmolLM2 language model", log):
        tokenizer = AutoTokenizer.from_pretrained(text_model)
        tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
        lm = LlamaForCausalLM.from_pretrained(text_model, dtype=torch.float32)
    with _step("Building the vision tower and connector", log):
        vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
        config = Idefics3Config(vision_config=vision.to_dict(), text_config=lm.config.to_dict(),
                                image_token_id=tokenizer.convert_tokens_to_ids("<image>"),  # type: ignore[arg-type]
                                scale_factor=SCALE_FACTOR, pad_token_id=lm.config.pad_token_id,
                                tie_word_embeddings=lm.config.tie_word_embeddings)
        torch.manual_seed(SEED)
        model = Idefics3ForConditionalGeneration(config)  # type: ignore[no-untyped-call]
        model.model.text_model.load_state_dict(lm.model.state_dict())
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with _step("Saving the model and its processor", log):
        model.save_pretrained(out)
        # One 128x128 image, never split into tiles: the image's <image> tokens stay one run (what
        # vLLM 0.32's /generate can carry, see render_sidecar/mm_placeholders.py).
        images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                           max_image_size={"longest_edge": IMAGE_SIZE})
        Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=image_seq_len(),
                          chat_template=tokenizer.chat_template).save_pretrained(out)


def check(folder: Path) -> None:
    """The folder reads back as an Idefics3 model whose processor makes the expected image tokens."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "idefics3" or not (folder / "processor_config.json").is_file():
        raise ModelPrepError(f"{folder} is not an Idefics3 model with a processor")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)  # type: ignore[no-untyped-call]
    if processor.image_seq_len != image_seq_len():
        raise ModelPrepError(f"{folder}: the processor expects {processor.image_seq_len} image tokens")


def ensure_vision_model(cache_dir: Path | None = None, *, log: Log = _log) -> Path:
    """The prepared folder, built first if needed (idempotent, lock-protected)."""
    cache = resolve_cache_dir(cache_dir)
    target = cache / VISION_DIR_NAME
    if is_prepared(target):
        log(f"already prepared: {target}")
        return target
    text_model = ensure_model(cache, log=log)
    with _locked_file(cache / f".{VISION_DIR_NAME}.lock"):
        if is_prepared(target):
            return target
        started = time.monotonic()
        with _built_beside(target, log, "incomplete or outdated") as partial:
            build(text_model, partial, log)
            with _step("Checking it loads as a vision model", log):
                check(partial)
            write_marker(partial, source=RECIPE)
        log(f"vision model ready: {target} (total {time.monotonic() - started:.1f}s)")
        return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m token_engine.vision_prep",
                                     description="Build the tiny vision-language model folder.")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        path = ensure_vision_model(args.cache_dir)
    except (ModelPrepError, OSError, ValueError) as exc:
        print(f"error: vision model preparation failed: {exc}", file=sys.stderr, flush=True)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
