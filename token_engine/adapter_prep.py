"""Small LoRA adapters for a prepared model, made locally and deterministically (no download).

Real fine-tunes would need a hub; what vLLM's LoRA path needs is an adapter folder in PEFT's format:
``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` whose keys are
``base_model.model.model.layers.{i}.self_attn.{q_proj,v_proj}.lora_{A,B}.weight`` with ``lora_A`` of
shape ``[r, in]`` and ``lora_B`` of shape ``[out, r]``. This module writes exactly that with torch and
safetensors (vLLM's own dependencies; PEFT itself is not needed to write its format). The weights are
seeded Gaussian noise times ``scale``: on SmolLM2-135M a scale of 0.09 changes greedy output (0.05 did
not; above about 0.11 the output turns to noise), and each seed gives another adapter.

CLI: ``python -m token_engine.adapter_prep MODEL_DIR OUT_DIR --seed N [--scale S] [--rank R]``;
prints OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = ("q_proj", "v_proj")


def make_adapter(model_dir: str | Path, out_dir: str | Path, *, seed: int, scale: float = 0.09,
                 rank: int = 8, alpha: int = 16) -> Path:
    """Write a LoRA adapter of ``model_dir`` (a Llama-shaped model) to ``out_dir``; the same arguments
    always give the same bytes. Returns ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    out_features = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            out_dim = out_features[target]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--scale", type=float, default=0.09)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    print(make_adapter(args.model_dir, args.out_dir, seed=args.seed, scale=args.scale, rank=args.rank))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
