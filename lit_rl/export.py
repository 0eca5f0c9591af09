"""Turn a training checkpoint into a Hugging Face `save_pretrained` directory (loadable by transformers and vLLM).

    python -m lit_rl.export runs/grpo/version_0/checkpoints/step=500.ckpt out/grpo-step500

The checkpoint is either a Lightning `.ckpt` file or a DeepSpeed checkpoint directory (ZeRO-2 or ZeRO-3 shards,
consolidated here on CPU; no GPU and no process group needed). The model's architecture and tokenizer come from
the checkpoint's own `model_name_or_path`; the weights are the policy's at the checkpoint's step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lit_rl.errors import DataFileNotFound, LitRLError
from lit_rl.models import load_tokenizer, resolve_model_path

POLICY_PREFIX = "policy."


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, consolidating DeepSpeed shards when `path` is a directory."""
    if not path.exists():
        raise DataFileNotFound(f"checkpoint {path} does not exist")
    if path.is_dir():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            consolidated = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(consolidated))
            return torch.load(consolidated, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path) -> Path:
    """Write the policy of `checkpoint_path` to `out_dir` with `save_pretrained`, tokenizer included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = load_checkpoint(Path(checkpoint_path))
    hparams = checkpoint.get("hyper_parameters") or {}
    name = hparams.get("model_name_or_path")
    if name is None:
        raise LitRLError(f"checkpoint {checkpoint_path} has no model_name_or_path in its hyper-parameters")
    trust_remote_code = bool(hparams.get("trust_remote_code", False))
    policy_state = {
        key[len(POLICY_PREFIX) :]: value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(POLICY_PREFIX)
    }
    if not policy_state:
        raise LitRLError(f"checkpoint {checkpoint_path} holds no policy weights (no 'policy.*' keys)")
    config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    config.dtype = next(iter(policy_state.values())).dtype
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(name, trust_remote_code=trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # training added a pad token
        model.resize_token_embeddings(len(tokenizer))
    missing, unexpected = model.load_state_dict(policy_state, strict=False)
    missing = [key for key in missing if key not in _tied_keys(model)]
    if missing or unexpected:
        raise LitRLError(
            f"checkpoint {checkpoint_path} does not match {name}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """Keys a checkpoint may omit because they share storage with another (tied input/output embeddings)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied.keys())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a .ckpt file or a DeepSpeed checkpoint directory")
    parser.add_argument("out_dir", help="where to write the save_pretrained directory")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir)
    except LitRLError as err:
        sys.stderr.write(f"lit-rl export: error: {err}\n")
        sys.exit(1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
