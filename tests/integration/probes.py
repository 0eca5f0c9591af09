"""Callbacks for tests: at the end of training, each rank writes what it ran with, as JSON."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import lightning as L


def probe_flags(name: str, directory: Path) -> tuple[str, ...]:
    """`lit-rl fit` flags that add the probe `name` (a class below), writing its JSON into `directory`."""
    return ("--trainer.callbacks+", f"tests.integration.probes.{name}", "--trainer.callbacks.directory", str(directory))


class _Probe(L.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def write(self, name: str, rank: int, value: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / f"{name}_rank{rank}.json").write_text(json.dumps(value))


class RecordEnginePlacement(_Probe):
    """`engine_rank<r>.json`: the colocated engine's `describe()` (read from vLLM's own state)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("engine", trainer.global_rank, pl_module.engines.built.describe())


class RecordPrecision(_Probe):
    """`precision_rank<r>.json`: the policy's parameter dtype, the dtype its forward computes in under the
    trainer's precision, and (GRPO) the resolved `model.rollout.correction`."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch

        ids = torch.tensor([[1, 2, 3]], device=pl_module.device)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            logits = pl_module.policy(input_ids=ids).logits
        resolve = getattr(pl_module, "rollout_correction", None)
        self.write(
            "precision",
            trainer.global_rank,
            {
                "parameters": str(next(pl_module.policy.parameters()).dtype).removeprefix("torch."),
                "logits": str(logits.dtype).removeprefix("torch."),
                "rollout_correction": resolve() if callable(resolve) else None,
            },
        )


class RecordRngAcrossValidation(_Probe):
    """`rng_rank<r>.json`: for each validation run, the step and whether the global torch RNG state (CPU, and
    this GPU's) at its end is the one at its start, i.e. whether validation left the trainer's stream alone."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.before = None
        self.records: list[dict] = []

    @staticmethod
    def _state(pl_module: L.LightningModule) -> list:
        import torch

        states = [torch.get_rng_state()]
        if pl_module.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(pl_module.device))
        return states

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = self._state(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        after = self._state(pl_module)
        unchanged = all(a.equal(b) for a, b in zip(self.before, after, strict=True))
        self.records.append({"step": trainer.global_step, "unchanged": unchanged})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("rng", trainer.global_rank, {"validations": self.records})


class RecordCompletionTokens(_Probe):
    """`tokens_rank<r>.json`: the completion tokens in this rank's rollout buffer at each optimizer step."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.tokens: list[int] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self.tokens.append(int(pl_module._buffer.completion_mask.sum()))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("tokens", trainer.global_rank, {"tokens_per_step": self.tokens})


class UseSnapshotEngine(L.Callback):
    """Make the on-policy module sample with `tests.snapshot_engine.SnapshotEngine` (HF generate on a copy of the
    policy, in a worker thread: an asynchronous engine without vLLM), on every rank, through the real CLI. Run with
    `--model.rollout.engine VLLMServer` so that `max_staleness > 0` is accepted; no server is contacted."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from tests.snapshot_engine import use_snapshot_engine

        use_snapshot_engine(pl_module)


class RecordDecodingWeights(_Probe):
    """`decoding_rank<r>.json`: over the policy's forwards in eval mode (decoding), how many there were, whether
    every parameter was whole at each (ZeRO-3's `ds_status` AVAILABLE; a parameter without one is whole) and the
    most forward hooks its modules carried then; whether every parameter was partitioned again after each
    `generate`; and the hooks its modules carry when training starts and when it ends."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_rl.rollout.engines.hf import HFGenerateEngine

        policy = pl_module.policy
        self.seen: list[dict] = []
        self.released: list[bool] = []
        self.hooks_before = _forward_hooks(policy)
        forward, self.generate = policy.forward, HFGenerateEngine.generate

        @functools.wraps(forward)  # `generate` reads the forward's signature (`logits_to_keep`, ...)
        def recording_forward(*args, **kwargs):
            if not policy.training:
                whole = all(_is_whole(p) for p in policy.parameters())
                self.seen.append({"whole": whole, "hooks": _forward_hooks(policy)})
            return forward(*args, **kwargs)

        def recording_generate(engine, *args, **kwargs):
            out = self.generate(engine, *args, **kwargs)
            self.released.append(not any(_is_whole(p) for p in policy.parameters()))
            return out

        policy.forward = recording_forward
        HFGenerateEngine.generate = recording_generate

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_rl.rollout.engines.hf import HFGenerateEngine

        HFGenerateEngine.generate = self.generate
        self.write(
            "decoding",
            trainer.global_rank,
            {
                "forwards": len(self.seen),
                "whole": all(seen["whole"] for seen in self.seen),
                "hooks_while_decoding": max((seen["hooks"] for seen in self.seen), default=0),
                "generations": len(self.released),
                "released_after_each": all(self.released),
                "hooks_before": self.hooks_before,
                "hooks_after": _forward_hooks(pl_module.policy),
            },
        )


def _forward_hooks(module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def _is_whole(param) -> bool:
    status = getattr(param, "ds_status", None)  # ZeRO-3's; other parameters are always whole
    return status is None or status.name == "AVAILABLE"


class RecordLabelledVersionGaps(_Probe):
    """`labelled_versions_rank<r>.json`: for each step, each policy version its rows were labelled with (a token's
    own with in-flight updates, else its row's) -> the largest gap between a model token's engine log-prob and the
    trainer's log-prob of it under that version's weights (kept as each step began). Zero up to numerics when every
    token was sampled by the version it carries; the loss's rollout correction divides by those engine log-probs."""

    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.weights: dict[int, dict] = {}  # version -> the policy's parameters when that step began
        self.gaps: dict[int, dict[int, float]] = {}
        self._scratch = None  # a copy of the policy to load old versions into

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self.step = trainer.global_step
        if self.step not in self.weights:
            self.weights[self.step] = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        import copy

        import torch

        from lit_rl.types import model_token_mask

        if self.step in self.gaps:  # the step's buffer, once
            return
        buffer = pl_module._buffer
        model_tokens = model_token_mask(buffer) > 0
        versions = buffer.token_versions
        if versions is None:
            versions = buffer.policy_version[:, None].expand_as(buffer.completion_ids)
        if self._scratch is None:
            self._scratch = copy.deepcopy(pl_module.policy)
        self.gaps[self.step] = {}
        for version in sorted(set(versions[model_tokens].tolist())):
            self._scratch.load_state_dict(self.weights[version])
            with torch.no_grad():
                scores = pl_module.score_completions(
                    self._scratch,
                    buffer.prompt_ids,
                    buffer.prompt_mask,
                    buffer.completion_ids,
                    buffer.completion_mask,
                    pl_module.sampling_args.temperature,
                )
            tokens = model_tokens & (versions == version)
            gap = (scores.logprobs - buffer.rollout_logprobs)[tokens].abs().max()
            self.gaps[self.step][int(version)] = float(gap)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("labelled_versions", trainer.global_rank, {str(step): gaps for step, gaps in self.gaps.items()})


class CountEngineCalls(_Probe):
    """`engine_calls_rank<r>.json`: how often training called the engine's `generate` (a collective on the server
    engine with several ranks) and, where it has one, its `concurrent_generate` (this rank's rows alone), and asked
    whether any rank still had episodes running (`any_rank_active`: an all-reduce each turn, when the ranks'
    episodes go turn by turn)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = pl_module.engines.started()
        counted = [(engine, "generate"), (engine, "concurrent_generate"), (pl_module.producer, "_any_rank_active")]
        counted = [(owner, name) for owner, name in counted if hasattr(owner, name)]
        self.calls = {name.lstrip("_"): 0 for _, name in counted}

        def counting(owner, name: str):
            call = getattr(owner, name)

            @functools.wraps(call)
            def count(*args, **kwargs):
                self.calls[name.lstrip("_")] += 1
                return call(*args, **kwargs)

            return count

        for owner, name in counted:
            setattr(owner, name, counting(owner, name))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write("engine_calls", trainer.global_rank, self.calls)


class FailOnRankOne(_Probe):
    """On rank 1 only, the engine's `concurrent_generate` (this rank's own turns, sent to the server apart from the
    other ranks) raises on its third call as a server lost to that rank would: an engine failure on one rank while
    the ranks sample apart. Writes `failed_rank1.json` when it has raised."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_rl.rollout.server.client import RolloutServerError

        engine = pl_module.engines.started()  # on every rank: connecting is a collective
        if trainer.global_rank != 1:
            return
        call, calls = engine.concurrent_generate, itertools.count(1)

        def failing(*args, **kwargs):
            if next(calls) == 3:
                self.write("failed", 1, {"call": 3})
                raise RolloutServerError("planted: the vLLM server stopped answering rank 1")
            return call(*args, **kwargs)

        engine.concurrent_generate = failing
