"""Hand-computed values for every DPO-family loss."""

import math

import pytest
import torch

from lit_rl.losses.dpo import dpo_loss


def logsig(x):
    return -math.log1p(math.exp(-x))


def sig(x):
    return 1 / (1 + math.exp(-x))


# One pair: policy chosen -3, rejected -5; reference chosen -4, rejected -4.
PC, PR, RC, RR = -3.0, -5.0, -4.0, -4.0
H = (PC - PR) - (RC - RR)  # 2.0
BETA = 0.1


def _loss(loss_type, **kwargs):
    t = lambda v: torch.tensor([v])  # noqa: E731
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), loss_type=loss_type, beta=BETA, **kwargs)


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("sigmoid", {}, -logsig(BETA * H)),
        ("sigmoid", {"label_smoothing": 0.1}, -0.9 * logsig(BETA * H) - 0.1 * logsig(-BETA * H)),
        ("robust", {"label_smoothing": 0.1}, (-0.9 * logsig(BETA * H) + 0.1 * logsig(-BETA * H)) / 0.8),
        ("hinge", {}, max(0.0, 1 - BETA * H)),
        ("ipo", {}, (H - 1 / (2 * BETA)) ** 2),
        ("apo_zero", {}, 1 - sig(BETA * (PC - RC)) + sig(BETA * (PR - RR))),
    ],
)
def test_dpo_losses_by_hand(loss_type, kwargs, expected):
    loss, stats = _loss(loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["chosen_rewards"].item() == pytest.approx(BETA * (PC - RC))  # 0.1
    assert stats["rejected_rewards"].item() == pytest.approx(BETA * (PR - RR))  # -0.1
    assert stats["margins"].item() == pytest.approx(0.2)
    assert stats["accuracies"].item() == 1.0


def test_simpo_is_reference_free_and_length_normalised():
    lengths_c, lengths_r = torch.tensor([3.0]), torch.tensor([5.0])
    loss, stats = dpo_loss(
        torch.tensor([PC]),
        torch.tensor([PR]),
        None,
        None,
        loss_type="simpo",
        beta=2.0,
        chosen_lengths=lengths_c,
        rejected_lengths=lengths_r,
        simpo_gamma=0.5,
    )
    margin = 2.0 * (PC / 3 - PR / 5) - 0.5  # 2 * (-1 + 1) - 0.5 = -0.5
    assert loss.item() == pytest.approx(-logsig(margin), rel=1e-6)
    assert stats["chosen_rewards"].item() == pytest.approx(-2.0)


def test_num_pairs_normalises_over_a_larger_batch():
    t = torch.tensor
    loss, stats = dpo_loss(t([PC, PC]), t([PR, PR]), t([RC, RC]), t([RR, RR]), beta=BETA, num_pairs=5)
    assert loss.item() == pytest.approx(2 * -logsig(BETA * H) / 5, rel=1e-6)


def test_gradient_pushes_chosen_up_and_rejected_down():
    pc, pr = torch.tensor([PC], requires_grad=True), torch.tensor([PR], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([RC]), torch.tensor([RR]), beta=BETA)
    loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()


def test_unknown_loss_and_missing_reference():
    with pytest.raises(ValueError, match="'kto'"):
        _loss("kto")
    with pytest.raises(ValueError, match="needs reference"):
        dpo_loss(torch.tensor([1.0]), torch.tensor([0.0]), None, None, loss_type="sigmoid")
