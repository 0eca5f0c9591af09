"""Loading policies and tokenizers through `transformers`, and the tiny offline model lit-rl ships.

`model_name_or_path` is a hub id or a local directory, loaded by the same `from_pretrained` call either way.
Names `lit-rl/<asset>` resolve to the directories shipped in `lit_rl/assets/` (an unknown asset name is an
error, not a hub lookup), so the default configs run offline from any working directory.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
from safetensors import SafetensorError

from lit_rl.errors import ConfigError, LitRLError, ModelNotFound, exception_line

log = logging.getLogger(__name__)

ASSETS_DIR = Path(__file__).parents[1] / "assets"
BUILTIN_PREFIX = "lit-rl/"
TINY_BASE = "tiny-qwen2-base"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
MODEL_DTYPES = tuple(_DTYPES)  # `model.policy.dtype`'s choices
MODEL_TORCH_DTYPES = {name: dtype for name, dtype in _DTYPES.items() if isinstance(dtype, torch.dtype)}


def resolve_model_path(name_or_path: str) -> str:
    """`lit-rl/<asset>` -> the shipped asset directory; anything else unchanged (hub id or local path)."""
    if name_or_path.startswith(BUILTIN_PREFIX):
        candidate = ASSETS_DIR / name_or_path[len(BUILTIN_PREFIX) :]
        if candidate.is_dir():
            return str(candidate)
    if name_or_path.startswith("~"):
        return str(Path(name_or_path).expanduser())
    return name_or_path


def _check_exists(name_or_path: str, resolved: str) -> None:
    """Fail early, naming the path, when a local path or a `lit-rl/` asset does not exist.

    `org/name` may be a hub id, so it is left to `from_pretrained`; anything that can only be a local path
    (absolute, `./`, `../`, `~`, or more than one `/`) must exist.
    """
    if Path(resolved).exists():
        return
    if name_or_path.startswith(BUILTIN_PREFIX):
        known = sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir())
        raise ModelNotFound(f"model {name_or_path!r}: no such built-in model (built-in: {known})")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelNotFound(f"model path {name_or_path!r} does not exist")


@contextmanager
def reading_model(name_or_path: str, resolved: str) -> Iterator[None]:
    """transformers' OSError for a model it cannot read (not in the cache offline, an unknown hub id, a directory
    without a config) -> one-line ModelNotFound naming the model and what to do; a local directory whose files
    cannot be read (no tokenizer files, an unknown `model_type`, a truncated `model.safetensors`: a ValueError,
    KeyError or safetensors' own error) -> one line naming the directory."""
    try:
        yield
    except LitRLError:
        raise
    except (ValueError, KeyError, SafetensorError) as err:
        if not Path(resolved).exists():
            raise
        raise ModelNotFound(f"model {name_or_path!r} ({resolved}) cannot be read: {exception_line(err)}") from err
    except OSError as err:
        lines = str(err).strip().splitlines()
        reason = lines[0] if lines else type(err).__name__
        if Path(resolved).exists():
            raise ModelNotFound(f"model {name_or_path!r}: {reason}") from err
        from lit_rl.data.hf_datasets import hub_offline

        hint = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache: download it on a machine with a "
            f"network (`hf download {name_or_path}`) or give a local directory"
            if hub_offline()
            else "check the id and the network (a private model needs `hf auth login`), or give a local directory"
        )
        raise ModelNotFound(
            f"model {name_or_path!r}: no local directory of that name, and the hub model could not be loaded "
            f"({reason}); {hint}"
        ) from err


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """AutoTokenizer padding on the left (every prompt then ends, and its completion starts, at the same column)
    with a pad token (EOS, or a new `<|pad|>`, with a warning when it had none)."""
    from transformers import AutoTokenizer

    resolved = resolve_model_path(name_or_path)
    _check_exists(name_or_path, resolved)
    with reading_model(name_or_path, resolved):
        tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
            log.warning("tokenizer of %r has no pad token; using its EOS token %r", name_or_path, tokenizer.eos_token)
        else:
            tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
            log.warning("tokenizer of %r has no pad or EOS token; added '<|pad|>'", name_or_path)
    return tokenizer


def load_model_config(name_or_path: str, trust_remote_code: bool = False) -> tuple[str, Any]:
    """The resolved path of a hub id, local directory or `lit-rl/<asset>`, and its `transformers` config."""
    from transformers import AutoConfig

    resolved = resolve_model_path(name_or_path)
    _check_exists(name_or_path, resolved)
    with reading_model(name_or_path, resolved):
        return resolved, AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)


def checkpoint_dtype(name_or_path: str, trust_remote_code: bool = False) -> Optional[str]:
    """The dtype `dtype: auto` loads `name_or_path` in (its config's `dtype`, e.g. "bfloat16"); None when the config
    names none (transformers then loads float32)."""
    _, config = load_model_config(name_or_path, trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def load_causal_lm(
    name_or_path: str,
    dtype: str = "float32",
    random_init: bool = False,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: Optional[str] = None,
    disable_dropout: bool = False,
    auto_class: Optional[Any] = None,
) -> torch.nn.Module:
    """AutoModelForCausalLM (or `auto_class`) from a hub id or local directory; `random_init` builds it from its
    config only.

    `disable_dropout` zeroes every dropout probability of the config and every `nn.Dropout`: RL losses compare
    log-probs of the same tokens under the same weights, which dropout would make differ.
    """
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    resolved, config = load_model_config(name_or_path, trust_remote_code)
    kwargs = {"trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if disable_dropout:
        for key, value in list(vars(config).items()):
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, 0.0)
    if random_init:
        model = auto_class.from_config(config, dtype=_DTYPES[dtype] if dtype != "auto" else None, **kwargs)
    else:
        with reading_model(name_or_path, resolved):
            model = auto_class.from_pretrained(resolved, config=config, dtype=_DTYPES[dtype], **kwargs)
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


# ----------------------------------------------------------------------------------------------------------------
# The tiny offline model: a Qwen2 architecture with a character-level tokenizer.

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
# Concatenates message contents: the tiny model has no chat roles, but chat-formatted prompts still go through
# the tokenizer's template like they do for real models.
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def model_eos_token_ids(model: torch.nn.Module, tokenizer_eos_id: Optional[int]) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models often end turns with a token that is not the tokenizer's EOS)."""
    ids = [] if tokenizer_eos_id is None else [tokenizer_eos_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return ids + [i for i in configured if i not in ids]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order: the 256 symbols of a byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def build_char_tokenizer(extra_tokens: Iterable[str] = (), model_max_length: int = 128):
    """A byte-level BPE with no merges (one token per byte: characters, for ASCII text), deterministic.

    It is a `Qwen2Tokenizer`, the class `AutoTokenizer` picks for a Qwen2 config (here and in vLLM), so every
    loader tokenizes the same way. Token ids: the 256 bytes, then `<|endoftext|>` (EOS) and `<|pad|>`, then
    `extra_tokens` (never produced by encoding, without merges, but decoded: a benchmark's large vocabulary).
    """
    from transformers import Qwen2Tokenizer

    vocab = {symbol: index for index, symbol in enumerate([*_byte_alphabet(), *SPECIAL_TOKENS, *extra_tokens])}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        chat_template=TINY_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def tiny_qwen2_config(
    vocab_size: int = 320,
    hidden_size: int = 128,
    num_hidden_layers: int = 4,
    intermediate_size: int = 512,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: Optional[int] = None,
    head_dim: int = 64,
    max_position_embeddings: int = 128,
):
    """Qwen2 with heads of head_dim 64 (vLLM's CPU attention needs 64). The defaults, hidden 128 and 4 layers, are
    the shipped tiny model (~1M parameters); hidden 512, 8 layers, intermediate 1024 is the ~20M benchmark model.
    The other arguments shape it like a real Qwen2.5 (`benchmarks/gpu_suite.py`); heads default to
    `hidden_size // head_dim`, key/value heads to the attention heads."""
    from transformers import Qwen2Config

    heads = num_attention_heads or hidden_size // head_dim
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=256 + SPECIAL_TOKENS.index("<|pad|>"),
        eos_token_id=256 + SPECIAL_TOKENS.index("<|endoftext|>"),
        bos_token_id=None,
        torch_dtype="float32",
    )


def build_tiny_base(out_dir: str | Path) -> Path:
    """Write the tokenizer and config of the tiny model (no weights: SFT starts it from a random init)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(out)
    config = tiny_qwen2_config()
    config.save_pretrained(out)
    # Normalise JSON key order so rebuilding gives byte-identical files.
    for name in ("config.json", "tokenizer_config.json"):
        path = out / name
        if path.exists():
            path.write_text(json.dumps(json.loads(path.read_text()), indent=2, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":  # python -m lit_rl.modeling.models [OUT_DIR]
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m lit_rl.modeling.models", description="Build the tiny Qwen2 base model, deterministically."
    )
    parser.add_argument("out_dir", nargs="?", default=str(ASSETS_DIR / TINY_BASE), help="where to write it")
    print(build_tiny_base(parser.parse_args().out_dir))
