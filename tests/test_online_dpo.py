import pytest
import torch

from lit_rl.algorithms import OnlineDPO
from lit_rl.types import RolloutBatch
from tests.conftest import build_tiny_reward_model, grouped_kwargs


def _batch(rewards):
    n = len(rewards)
    zeros = torch.zeros(n, 2)
    return RolloutBatch(
        zeros.long(),
        zeros.long(),
        zeros.long(),
        zeros,
        zeros,
        torch.tensor(rewards),
        torch.tensor(rewards)[:, None],
        torch.zeros(n),
        torch.zeros(n),
    )


def test_pairs_are_ranked_by_reward_and_ties_get_no_label():
    module = OnlineDPO()
    batch = _batch([1.0, 0.0, 0.2, 0.7, 0.5, 0.5])
    module.finish_rollout(batch, batch.rewards, slice(0, len(batch)), None)
    assert batch.advantages.tolist() == [1.0, -1.0, -1.0, 1.0, 0.0, 0.0]


def test_a_step_of_tied_pairs_logs_no_pair_metric_rather_than_nan():
    """The pair metrics are means over untied pairs: a step whose pairs all tie (a saturated reward) has none, and
    computes none of them (`log_collection` logs NaN for them once they have been logged: test_metrics); one untied
    pair in another micro-batch is the step's value."""
    from lit_rl.training.metrics import compute_collection

    module = OnlineDPO()
    stats = {key: torch.tensor([0.5]) for key in ("chosen_rewards", "rejected_rewards", "accuracies", "margins")}
    stats |= {"chosen_logps": torch.tensor([-1.0]), "rejected_logps": torch.tensor([-2.0])}
    mb = _batch([1.0, 1.0])
    module.update_algorithm_metrics(mb, torch.tensor(0.0), {**stats, "untied": torch.tensor([0.0])})
    logged = compute_collection(module.train_metrics)
    assert logged["frac_tied_pairs"] == 1.0 and "rewards/margins" not in logged
    assert all(not torch.isnan(value).any() for value in logged.values())
    module.train_metrics.reset()
    module.update_algorithm_metrics(mb, torch.tensor(0.0), {**stats, "untied": torch.tensor([0.0])})
    module.update_algorithm_metrics(mb, torch.tensor(0.0), {**stats, "untied": torch.tensor([1.0])})
    logged = compute_collection(module.train_metrics)
    assert logged["frac_tied_pairs"] == 0.5 and logged["rewards/margins"] == 0.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 4}, "num_generations must be 2"),
        ({"micro_batch_size": 3}, "micro_batch_size must be even"),
        ({"loss_type": "simpo"}, "model.loss.type must be one of"),
    ],
)
def test_bad_settings_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OnlineDPO(**grouped_kwargs(OnlineDPO, **kwargs))


def test_a_reward_function_named_as_a_pair_metric_is_refused(tmp_path, monkeypatch):
    """A function `accuracies` logged as `train/rewards/accuracies`, the metric of DPO's pair accuracy: one metric
    averaged the function's scores and the pairs' accuracy together."""
    source = "def accuracies(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    (tmp_path / "pair_named_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="reward function 'accuracies' would log as train/rewards/accuracies"):
        OnlineDPO(**grouped_kwargs(OnlineDPO, reward_funcs=["pair_named_rewards.accuracies"]))


def test_a_reward_model_given_by_path_ranks_the_pairs(tmp_path):
    from lit_rl.rewards.model import RewardModel

    build_tiny_reward_model(tmp_path / "rm")
    judge = RewardModel(str(tmp_path / "rm"))
    scores = judge(["1+2=", "1+2=", [{"role": "user", "content": "1+2="}]], ["3", "4", "3"])
    assert len(scores) == 3 and scores[0] != scores[1]
    assert scores[2] == pytest.approx(scores[0], abs=1e-5)  # the tiny chat template concatenates contents

    module = OnlineDPO(**grouped_kwargs(OnlineDPO, reward_funcs=[], reward_model_name_or_path=str(tmp_path / "rm")))
    scorer = module.reward_scorer
    assert scorer.names == ["reward_model"] and scorer.weights.tolist() == [1.0]
    assert "val/rewards/reward_model" in module.val_metrics.keys()
    both = OnlineDPO(
        **grouped_kwargs(
            OnlineDPO,
            reward_funcs=["lit_rl.rewards.arithmetic.correctness"],
            reward_weights=[1.0, 0.5],
            reward_model_name_or_path=str(tmp_path / "rm"),
        )
    )
    assert both.reward_scorer.names == ["correctness", "reward_model"]
    assert both.reward_scorer.weights.tolist() == [1.0, 0.5]


def test_with_an_environment_a_sequences_log_probability_is_the_models_tokens_alone():
    """Online DPO on Countdown episodes (up to 3 model turns, observations between): the loss has no gradient at an
    observation token, and one at the model's tokens of every untied pair."""
    from tests.conftest import fit_on_episodes

    model, observations = fit_on_episodes("OnlineDPO", num_generations=2)
    buffer = model._buffer
    buffer.advantages = torch.tensor([1.0, -1.0]).repeat(len(buffer) // 2)  # every pair untied: first chosen
    logprobs = buffer.old_logprobs.clone().requires_grad_(True)
    loss, _ = model.micro_batch_loss(buffer, model.micro_batch_terms(buffer, logprobs), model._normalizers[0])
    loss.backward()
    assert (logprobs.grad[observations] == 0).all()
    assert (logprobs.grad.view(-1, 2, logprobs.shape[1])[:, 0] != 0).any(dim=1).all()  # every chosen row
