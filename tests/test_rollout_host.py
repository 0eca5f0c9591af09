"""The rollout parts (producers, the engine owner, dynamic sampling, an engine config's `build`) use of the module
that holds them only what `lit_rl.rollout.host.RolloutHost` declares: checked on the source, and by running a
producer with a host that has nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import torch

from lit_rl.config import RewardArgs
from lit_rl.rewards.scorer import RewardScorer
from lit_rl.rollout import RolloutOutput, SamplingParams
from lit_rl.rollout.dynamic_sampling import DynamicSampling
from lit_rl.rollout.engine_config import HFGenerate
from lit_rl.rollout.engine_owner import EngineOwner
from lit_rl.rollout.host import RolloutHost
from lit_rl.rollout.producer import GroupFilterStats, ProducerParts, RolloutProducer
from lit_rl.training.perf import BusyClock, StepTimer

ROLLOUT = Path(__file__).resolve().parents[1] / "lit_rl" / "rollout"
HOST_AS_MODULE = ("engine_config.py",)  # where the host is `module`: an engine config's `build` argument


def _declared() -> set[str]:
    members = set(RolloutHost.__annotations__)
    members |= {name for name, _ in inspect.getmembers(RolloutHost, inspect.isfunction) if not name.startswith("_")}
    return members


def _host_attributes(path: Path) -> set[tuple[int, str]]:
    """Attributes read from a host: `self.host.x`, `self.inner.host.x`, `host.x`, and an engine config's
    `module.x` (the argument of `build`; elsewhere `module` is a torch module)."""
    names = ("host", "module") if path.name in HOST_AS_MODULE else ("host",)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        is_host = (isinstance(value, ast.Name) and value.id in names) or (
            isinstance(value, ast.Attribute) and value.attr == "host"
        )
        if is_host:
            found.add((node.lineno, node.attr))
    return found


def test_the_rollout_parts_read_only_what_the_host_declares():
    declared = _declared()
    assert {"trainer", "timer", "tokenizer", "all_gather"} <= declared
    seen = set()
    for path in sorted(ROLLOUT.rglob("*.py")):  # every rollout part, the engines and servers among them
        for line, attr in _host_attributes(path):
            assert attr in declared, (
                f"{path.relative_to(ROLLOUT.parent)}:{line} reads host.{attr}, which RolloutHost does not declare"
            )
            seen.add(attr)
    assert {"trainer", "timer", "tokenizer", "policy"} <= seen  # the scan sees the reads it checks


class _Engine:
    """Answers the prompts with the next digits of `answers` (ids 0-9 are the digits), each then EOS (10)."""

    needs_weights = False

    def __init__(self, answers):
        self.answers = list(answers)

    def generate(self, prompt_ids, prompt_mask, params, seeds=None):
        answers, self.answers = self.answers[: len(prompt_ids)], self.answers[len(prompt_ids) :]
        ids = torch.tensor([[answer, 10] for answer in answers])
        return RolloutOutput(ids, torch.ones(ids.shape), torch.full(ids.shape, -0.5))

    def close(self):
        pass


class _Tokenizer:
    pad_token_id = 11

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(str(i) for i in row.tolist() if i < 10) for row in ids]


def _host(world_size: int = 1) -> SimpleNamespace:
    """A host with the members `RolloutHost` declares and nothing else."""
    trainer = SimpleNamespace(global_step=3, max_steps=10, current_epoch=0, world_size=world_size, global_rank=0)
    clock = BusyClock()
    host = SimpleNamespace(
        trainer=trainer,
        device=torch.device("cpu"),
        policy=None,
        tokenizer=_Tokenizer(),
        policy_args=None,
        timer=StepTimer(clock),
        engine_clock=clock,
        all_gather=lambda tensor: tensor,
        gather_stacked=lambda tensor: tensor[None],
        compute_dtype=lambda: torch.float32,
        parameters_sharded=lambda: False,
        attached_strategy=lambda: None,
    )
    assert set(vars(host)) == _declared()
    return host


def _producer(answers) -> RolloutProducer:
    host = _host()
    engines = EngineOwner(HFGenerate(), host)
    engines.build = lambda: _Engine(answers)
    scorer = RewardScorer(RewardArgs(funcs=["lit_rl.rewards.arithmetic.correctness"]))
    prompts = SimpleNamespace(  # the prompt encoder: two tokens a prompt
        encode=lambda prompts, tools=None, per_prompt_tools=None, device=None: (
            torch.ones(len(prompts), 2, dtype=torch.long),
            torch.ones(len(prompts), 2),
        )
    )
    return RolloutProducer(ProducerParts(host, engines, scorer, SamplingParams(max_new_tokens=2), prompts))


def test_a_producer_samples_and_scores_a_generation_with_only_the_declared_host():
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": "5"}]
    scored = _producer([3, 4]).generation(0, rows)
    assert scored.rewards.tolist() == [1.0, 0.0] and scored.reward_components.shape == (2, 1)
    assert scored.version == 3 and scored.output.completion_ids.tolist() == [[3, 10], [4, 10]]
    assert scored.group_filter is None  # a plain producer filters no groups


def test_dynamic_sampling_replaces_a_group_whose_rewards_agree_with_a_refill():
    # Groups of 2: the first group's rewards agree (both wrong), the second's differ; the refill's first differs.
    rows = [{"prompt": "p", "answer": a} for a in ("3", "3", "4", "5")]
    producer = _producer([1, 1, 4, 4, 7, 8, 1, 1])
    wrapped = DynamicSampling(producer, group_size=2, shape_rewards=lambda rewards, out: rewards)
    refill_rows = [{"prompt": "q", "answer": a} for a in ("7", "1", "2", "2")]
    scored = wrapped.generation(0, rows, [refill_rows])
    # The kept groups, in order: the generation's second, then the refill's first.
    assert scored.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scored.group_filter == GroupFilterStats(refill_generations=1, frac_groups_dropped=0.5)
    assert wrapped.reward_names == ["correctness"] and wrapped.completion_budget == 2


def test_validation_counts_only_the_rows_of_weight_1_in_a_padded_batch():
    """A rank's validation share is padded to full batches with copies of weight 0 (`lit_rl.data.sharding`: 7 prompts
    over 2 ranks in batches of 16 hold 9 and 12 copies); its metrics count the weight-1 rows alone, so every `val/`
    value is the exact one over the prompts. The same two rows, with and without two padding copies of one of
    them (whose greedy completions are its own, as each row samples alone), log the same numbers."""
    import torch

    from tests.conftest import fit_grpo

    model = fit_grpo()
    first = model.trainer.datamodule.train_rows[0]
    second = {**first, "answer": f"{first['answer']}1"}  # its completion scores apart from the first's

    def validated(rows, weight):
        model.val_metrics.reset()
        model.validation_step({"rows": rows, "weight": torch.tensor(weight)}, 0)
        return {name: float(metric.compute()) for name, metric in model.val_metrics.items() if metric.update_called}

    plain = validated([first, second], [1.0, 1.0])
    padded = validated([first, second, second, second], [1.0, 1.0, 0.0, 0.0])
    assert padded == plain
    counted = validated([first, second, second, second], [1.0, 1.0, 1.0, 1.0])  # what counting the copies gives
    assert counted != plain  # the copies count where weighed 1: the comparison above can see the weight
