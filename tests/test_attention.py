"""`model.policy.attn_implementation`: the attention kernel of the policy, its reference and PPO's critic, the same
numbers as the model's default kernel to float rounding, and only transformers' built-in kernels."""

import pytest
import torch

from lit_rl.algorithms import DPO, PPO
from lit_rl.config import ATTENTION_IMPLEMENTATIONS, PolicyArgs
from lit_rl.errors import ConfigError
from lit_rl.training.compat import flash_attention_installed
from tests.conftest import fit_config, grouped_kwargs, train_rows


def test_the_attention_kernel_reaches_the_policy_the_reference_and_the_critic():
    module = PPO(**grouped_kwargs(PPO, policy={"attn_implementation": "eager"}))
    module.configure_model()
    critic_decoder = next(module.critic.children())
    with module.reference_model() as reference:
        kernels = [m.config._attn_implementation for m in (module.policy, reference, critic_decoder)]
    assert kernels == ["eager"] * 3
    default = DPO()
    default.configure_model()
    assert default.policy.config._attn_implementation == "sdpa"  # None: the model's own choice


@pytest.mark.parametrize("kernel", ["kernels-community/flash-attn", "flash", ""])
def test_only_built_in_kernels_are_taken(kernel):
    # A hub kernel ("org/repo") would be downloaded and run: the same trust as remote model code.
    with pytest.raises(ConfigError, match="model.policy.attn_implementation must be one of"):
        PolicyArgs(attn_implementation=kernel).check()


def test_the_built_in_kernels_that_need_no_package_are_taken():
    for name in ATTENTION_IMPLEMENTATIONS:
        if not name.startswith("flash_attention_"):
            PolicyArgs(attn_implementation=name).check()


@pytest.mark.parametrize("kernel", ["flash_attention_2", "flash_attention_3", "flash_attention_4"])
def test_a_flash_kernel_needs_its_package_not_a_download(kernel):
    # Without the package, transformers would fetch `kernels-community/...` from the hub in its place.
    if flash_attention_installed(kernel):
        PolicyArgs(attn_implementation=kernel).check()
        return
    with pytest.raises(ConfigError, match=f"attn_implementation={kernel} needs its flash-attn package installed"):
        PolicyArgs(attn_implementation=kernel).check()


def test_dpo_with_eager_attention_trains_to_the_sdpa_numbers(tmp_path):
    common = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--data.batch_size", "8"]
    sdpa = fit_config(tmp_path, "sdpa", "dpo.yaml", *common, every_n=2)
    eager = fit_config(tmp_path, "eager", "dpo.yaml", *common, "--model.policy.attn_implementation", "eager", every_n=2)
    a, b = train_rows(sdpa), train_rows(eager)
    assert len(a) == len(b) == 2
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            if key.startswith("train/"):
                assert abs(row_a[key] - row_b[key]) <= 1e-5 * max(1.0, abs(row_a[key])), key
    saved = [torch.load(run / "checkpoints" / "step=2.ckpt", weights_only=False) for run in (sdpa, eager)]
    assert [c["hyper_parameters"]["policy"]["attn_implementation"] for c in saved] == [None, "eager"]
    states = [checkpoint["state_dict"] for checkpoint in saved]
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=1e-5)
