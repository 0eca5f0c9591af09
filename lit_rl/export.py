"""Turn a training checkpoint into a Hugging Face `save_pretrained` directory (loadable by transformers and vLLM).

    lit-rl export runs/grpo/version_0/checkpoints/step=500.ckpt out/grpo-step500   # or python -m lit_rl.export

The checkpoint is either a Lightning `.ckpt` file or a DeepSpeed checkpoint directory (ZeRO-2 or ZeRO-3 shards,
consolidated here on CPU; no GPU and no process group needed). The model's architecture and tokenizer come from
the checkpoint's own `model_name_or_path`; the weights are the policy's at the checkpoint's step. A LoRA
checkpoint gives the merged model, or with `--adapter` the peft adapter alone. A PPO checkpoint's critic is written
to `out_dir/critic` (a one-label `AutoModelForTokenClassification`).

`out_dir` is new, empty, or an earlier export (every file in it, its `critic/` too, listed in the `.lit-rl-export`
that export wrote): it is written beside and swapped in whole, so no file of an earlier export stays, and a failed
export leaves it as it was. A directory holding anything else (a run's directory, files of yours, a model the
checkpoint was trained from, the working directory) is refused in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

import torch
from transformers import AutoConfig

from lit_rl.config import grouped_hparams
from lit_rl.errors import DataFileNotFound, LitRLError, ModelNotFound, OneLineArgumentParser, exception_line
from lit_rl.modeling.lora import apply_lora, as_lora_config, save_merged, trainable_keys
from lit_rl.modeling.models import load_causal_lm, load_tokenizer, reading_model, resolve_model_path
from lit_rl.modeling.value_model import save_value_state
from lit_rl.resume import CheckpointError
from lit_rl.training.checkpoint import publish_directory

POLICY_PREFIX = "policy."
CRITIC_PREFIX = "critic."


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict, consolidating DeepSpeed shards when `path` is a directory.

    A `.ckpt` file is read with `weights_only=True`: tensors and plain containers, never code, whoever made it.
    DeepSpeed's converter unpickles the shard files of a checkpoint directory itself: export only directories you
    (or someone you trust) wrote."""
    if not path.exists():
        raise DataFileNotFound(f"checkpoint {path} does not exist")
    if path.is_dir():
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            consolidated = Path(tmp) / "consolidated.ckpt"
            try:
                convert_zero_checkpoint_to_fp32_state_dict(str(path), str(consolidated))
            except Exception as err:  # not a DeepSpeed checkpoint, or a damaged one
                raise CheckpointError(f"checkpoint directory {path} cannot be read ({exception_line(err)})") from err
            return torch.load(consolidated, map_location="cpu", weights_only=True)
    try:
        with open(path, "rb") as file:
            return _load_weights_only(path, file)
    except OSError as err:  # unreadable: permissions, a special file
        raise CheckpointError(f"checkpoint {path} cannot be read ({exception_line(err)})") from err


def _load_weights_only(path: Path, file: BinaryIO) -> dict[str, Any]:
    """`torch.load(weights_only=True)` of an open checkpoint file; what it refuses as one line.

    Only a GLOBAL that torch refuses to import is "may run code": the class or function a crafted pickle would
    call. Any other unpickling failure is a file that is no checkpoint at all (a YAML file: `Unsupported operand`)
    or a damaged one, and so is a refused GLOBAL whose name runs to the end of the file: an old-format (non-zip)
    checkpoint cut short inside the name of a class it holds (`torch._utils._rebui`), not a class of its own."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", str(err), re.IGNORECASE)
        cut_short = file.tell() >= os.fstat(file.fileno()).st_size
        if refused and not cut_short:
            raise LitRLError(
                f"checkpoint {path} holds objects other than tensors and plain containers ({refused.group(1)}), "
                "which lit-rl does not unpickle: it may run code"
            ) from None
        reason = "it ends inside a pickled name: truncated?" if refused else _unpickling_line(err)
        raise CheckpointError(f"checkpoint {path} cannot be read ({reason})") from err
    except Exception as err:  # truncated, damaged, not a checkpoint
        raise CheckpointError(f"checkpoint {path} cannot be read ({exception_line(err)})") from err


def _unpickling_line(err: pickle.UnpicklingError) -> str:
    """The unpickler's own message (`UnpicklingError: Unsupported operand 35`), not the first line torch wraps it
    in, which suggests `weights_only=False`: the one thing not to do with a file of unknown origin."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
    return f"{type(err).__name__}: {found.group(1).strip()}" if found else exception_line(err)


def export_checkpoint(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    adapter_only: bool = False,
    trust_remote_code: Sequence[str] = (),
) -> Path:
    """Write the policy of `checkpoint_path` to `out_dir` with `save_pretrained`, tokenizer included.

    A LoRA checkpoint (trained with `model.policy.lora`) holds the adapter only: the frozen weights are loaded from its
    `model_name_or_path` (which must be unchanged since training), and `out_dir` gets the merged model, or with
    `adapter_only` the peft adapter (`PeftModel.from_pretrained(base, out_dir)`).

    `trust_remote_code` names the repositories whose code the caller trusts; it is the caller's to give, never the
    checkpoint's. A checkpoint trained with trust_remote_code is refused, naming every repository whose code loading
    it would run (the policy's, and a PPO critic's own), unless each is named; code from a repository not named is
    never run.
    """
    out = writable_out_dir(Path(out_dir))
    checkpoint = load_checkpoint(Path(checkpoint_path))
    hparams = grouped_hparams(checkpoint.get("hyper_parameters") or {})  # a 0.1 checkpoint's flat keys too
    policy = hparams.get("policy") or {}
    name = policy.get("model_name_or_path")
    if name is None:
        raise LitRLError(f"checkpoint {checkpoint_path} has no policy.model_name_or_path in its hyper-parameters")
    critic_state = {
        key[len(CRITIC_PREFIX) :]: value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(CRITIC_PREFIX)
    }
    critic_name = (hparams.get("critic_model_name_or_path") or name) if critic_state else None
    # The models a checkpoint's run reads besides its policy: a PPO critic, DPO's reference, Online DPO's judge.
    others = (critic_name, hparams.get("ref_model_name_or_path"), hparams.get("reward_model_name_or_path"))
    refuse_model_directories(out, [repo for repo in (name, *others) if isinstance(repo, str)])
    if isinstance(trust_remote_code, (str, bool)):  # a name would be read letter by letter, True as trust for all
        raise LitRLError(f"trust_remote_code takes the repositories to trust, as a list, got {trust_remote_code!r}")
    trusted = {resolve_model_path(repo) for repo in trust_remote_code}  # `~/model` and `./model` as the loader reads
    if policy.get("trust_remote_code"):
        with_code = list(dict.fromkeys(repo for repo in (name, critic_name) if repo is not None))
        untrusted = [repo for repo in with_code if resolve_model_path(repo) not in trusted]
        if untrusted:
            flags = " ".join(f"--trust-remote-code {shlex.quote(repo)}" for repo in untrusted)
            raise LitRLError(
                f"checkpoint {checkpoint_path} was trained with trust_remote_code: loading it runs code from "
                f"{', '.join(repr(repo) for repo in with_code)}; name each repository you trust ({flags})"
            )
    trust_policy = resolve_model_path(name) in trusted
    policy_state = {
        key[len(POLICY_PREFIX) :]: value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(POLICY_PREFIX)
    }
    if not policy_state:
        raise LitRLError(f"checkpoint {checkpoint_path} holds no policy weights (no 'policy.*' keys)")
    lora = as_lora_config(policy.get("lora"))
    if lora is None and adapter_only:
        raise LitRLError(
            f"checkpoint {checkpoint_path} was not trained with model.policy.lora: it has no adapter to export"
        )
    tokenizer = load_tokenizer(name, trust_remote_code=trust_policy)
    if lora is None:
        model = _model_from_config(name, trust_policy, next(iter(policy_state.values())).dtype, tokenizer)
        _load_weights(model, policy_state, checkpoint_path, name, may_miss=_tied_keys(model))
    else:
        model = load_causal_lm(name, dtype=policy.get("dtype", "float32"), trust_remote_code=trust_policy)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        model = apply_lora(model, lora)
        frozen = set(model.state_dict()) - trainable_keys(model)  # loaded from `name` above
        _load_weights(model, policy_state, checkpoint_path, name, may_miss=frozen)
    critic_config = None
    if critic_name is not None:  # read before anything is written
        critic_path = resolve_model_path(critic_name)
        with reading_model(critic_name, critic_path):
            critic_config = AutoConfig.from_pretrained(critic_path, trust_remote_code=critic_path in trusted)

    def write(directory: Path) -> None:
        if lora is not None and not adapter_only:
            save_merged(model, directory)
        else:
            model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        if critic_config is not None:
            save_value_state(critic_config, critic_state, directory / "critic")

    publish_export(out, write)
    return Path(out_dir)


def publish_export(out: Path, write: Callable[[Path], None]) -> None:
    """`write` an export into a directory of its own beside `out` (two exports at once never share one), list its
    files in `MANIFEST`, and swap it in for `out` whole: an earlier export's files (a critic/, merged weights beside
    an adapter) never stay mixed with this one's, and a failed export leaves `out` as it was. `out` is checked again
    just before the swap: loading the checkpoint can take minutes, and another export may have written there."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    except OSError as err:
        raise LitRLError(f"out_dir {out}: cannot write beside it ({exception_line(err)})") from err
    try:
        write(tmp)
        listed = _files_under(tmp)
        (tmp / MANIFEST).write_text(json.dumps(listed))
        writable_out_dir(out)
        try:
            publish_directory(tmp, out)
        except OSError as err:  # a mount point, another device; a failed clean-up after the swap is not a failure
            if _exported_names(out) != set(listed):
                raise LitRLError(f"out_dir {out}: cannot be replaced ({exception_line(err)})") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# The list of what an export wrote, kept in it: the files a later export may replace.
MANIFEST = ".lit-rl-export"


def writable_out_dir(out: Path) -> Path:
    """`out` resolved (`.`, a symlink), checked before the checkpoint loads: a directory that is missing, empty or
    an earlier export (each of its files listed in its `MANIFEST`), which the export replaces whole; anything else
    (a file, a run's directory, a folder of the user's, the working directory or one above it) is refused in one line
    naming what is there."""
    resolved = out.resolve()
    if resolved == resolved.parent or resolved == Path.cwd() or resolved in Path.cwd().parents:
        raise LitRLError(f"out_dir {out}: the working directory or one above it; give a directory of its own")
    if resolved.exists() and not resolved.is_dir():
        raise LitRLError(f"out_dir {out} is a file: give the directory to write")
    found = _files_under(resolved) if resolved.exists() else []
    others = [name for name in found if name not in _exported_names(resolved)]
    if others:
        raise LitRLError(
            f"out_dir {out} holds files a lit-rl export did not write ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}), which replacing it would delete: give a new or empty directory"
        )
    return resolved


def refuse_model_directories(out: Path, models: Sequence[str]) -> None:
    """An earlier export that is the model the checkpoint was trained from (a LoRA run's base, a PPO critic's) cannot
    be replaced: the checkpoint's frozen weights are read from it."""
    for model in models:
        if Path(resolve_model_path(model)).resolve() == out:
            raise LitRLError(f"out_dir {out} is {model!r}, which this checkpoint was trained from: give another")


def _files_under(directory: Path) -> list[str]:
    """Every file below `directory` (its subdirectories' too: a `critic/`), as relative paths, but the manifest."""
    found = (path.relative_to(directory).as_posix() for path in directory.rglob("*") if not path.is_dir())
    return sorted(name for name in found if name != MANIFEST)


def _exported_names(directory: Path) -> set[str]:
    try:
        return set(json.loads((directory / MANIFEST).read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _model_from_config(name: str, trust_remote_code: bool, dtype: torch.dtype, tokenizer: Any) -> torch.nn.Module:
    """The architecture of `name` with uninitialised weights of `dtype`, sized for `tokenizer`, and `name`'s
    generation settings (`generation_config.json`: an instruct model's end-of-turn stop tokens, its sampling
    defaults), which `from_config` would derive from `config.json` alone, as the run's own `hf/` keeps them."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    settings = _generation_settings(name, path)
    if settings is not None:
        model.generation_config = settings
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # training added a pad token
        model.resize_token_embeddings(len(tokenizer))
    return model


def _generation_settings(name: str, path: str) -> Any:
    """`name`'s `generation_config.json` (at `path`), or None where it has none or one `save_pretrained` would
    refuse (`temperature` without `do_sample`: transformers loads it with a warning, then fails to save it), said
    in one line: the export then has the one derived from `config.json`."""
    from transformers import GenerationConfig

    try:
        settings = GenerationConfig.from_pretrained(path)
        settings.validate(strict=True)  # as `save_pretrained` will
    except OSError:
        return None
    except ValueError as err:
        first = str(err).strip().splitlines()[1:2] or [exception_line(err)]
        sys.stderr.write(
            f"lit-rl export: {name}'s generation_config.json is not one transformers saves ({first[0].lstrip('- ')}):"
            " the export has the one derived from config.json\n"
        )
        return None
    return settings


def _load_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor], checkpoint_path: Any, name: str, may_miss: set[str]
) -> None:
    """Load `state` into `model`; every key must match, except the `may_miss` ones the checkpoint may omit."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if key not in may_miss]
    if missing or unexpected:
        raise LitRLError(
            f"checkpoint {checkpoint_path} does not match {name}: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


def _tied_keys(model: torch.nn.Module) -> set[str]:
    """Keys a checkpoint may omit because they share storage with another (tied input/output embeddings)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if not isinstance(tied, dict) else set(tied.keys())


# A checkpoint names its models as its run was given them: a relative path is relative to where the run started.
RELATIVE_PATH_HINT = (
    " here (a checkpoint keeps its model paths as the run was given them: run lit-rl export from the folder the run "
    "was started in for a relative one)"
)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineArgumentParser(
        prog="lit-rl export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a .ckpt file or a DeepSpeed checkpoint directory")
    parser.add_argument("out_dir", help="where to write the save_pretrained directory")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="for a LoRA checkpoint: write the peft adapter only (default: the model with the adapter merged in)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="append",
        default=[],
        metavar="REPO",
        help="run the code of repository REPO (a hub id or folder; once per repository): needed for a checkpoint "
        "trained with trust_remote_code, for its policy's repository and a PPO critic's own (a refusal names them)",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint, args.out_dir, adapter_only=args.adapter, trust_remote_code=args.trust_remote_code
        )
    except ModelNotFound as err:  # a model path of the checkpoint's run, relative to where that run started
        relative = "" if "does not exist" not in str(err) else RELATIVE_PATH_HINT
        sys.stderr.write(f"lit-rl export: error: {err}{relative}\n")
        sys.exit(1)
    except LitRLError as err:
        sys.stderr.write(f"lit-rl export: error: {err}\n")
        sys.exit(1)
    except OSError as err:  # transformers' for a model or config it cannot read (a PPO critic's), a full disk
        sys.stderr.write(f"lit-rl export: error: {exception_line(err)}\n")
        sys.exit(1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
