"""LoRA (`model.policy.lora`): merged weights, the adapter-off reference, what trains, what a checkpoint holds."""

import copy

import pytest
import torch

from lit_rl.algorithms import DPO, GRPO, SFT
from lit_rl.algorithms.base import PolicyModule
from lit_rl.errors import ConfigError
from lit_rl.modeling.lora import LoRAConfig, merged_view, merged_weights, reference_view, trainable_keys
from lit_rl.modeling.models import load_causal_lm
from tests.conftest import fit_grpo, grouped_kwargs, perturbed_lora_model

SFT_MODEL = "lit-rl/tiny-qwen2-addition-sft"


def test_merged_weights_equal_peft_merge_and_carry_the_plain_model_names():
    model = perturbed_lora_model(modules_to_save=["norm"])
    merged = dict(merged_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    plain_names = set(load_causal_lm(SFT_MODEL).state_dict())
    assert set(merged) == set(reference) == plain_names
    for name, value in reference.items():
        assert torch.equal(merged[name], value), name
    # The frozen weights themselves are untouched: nothing was merged in place.
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert not q_proj.merged
    assert not torch.equal(q_proj.base_layer.weight, merged["model.layers.0.self_attn.q_proj.weight"])


def test_adapter_off_is_exactly_the_starting_model():
    plain = load_causal_lm(SFT_MODEL, disable_dropout=True)
    model = perturbed_lora_model()
    ids = torch.randint(0, 256, (3, 9))
    expected = plain(ids).logits
    with torch.no_grad(), reference_view(model):
        assert torch.equal(model(ids).logits, expected)
    assert (model(ids).logits - expected).abs().max() > 0.1  # the adapter is back on after the block


def test_merged_view_computes_as_the_plain_model_with_merged_weights_and_restores_every_weight():
    """What an engine holding merged weights (vLLM) computes, inside the trainer's own model: the merged weights of
    `merged_weights`, bit for bit; on exit the frozen weights and the adapter path are exactly as before."""
    model = perturbed_lora_model(modules_to_save=["norm"])
    plain = load_causal_lm(SFT_MODEL, disable_dropout=True)
    plain.load_state_dict(dict(merged_weights(model)))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    ids = torch.randint(0, 256, (3, 9))
    with torch.no_grad():
        adapter_logits = model(ids).logits
        with merged_view(model):
            merged_logits = model(ids).logits
        assert torch.equal(merged_logits, plain(ids).logits)
        assert not torch.equal(merged_logits, adapter_logits)  # float32 rounds the two paths differently
        torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(model(ids).logits, adapter_logits)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_hf_engine_samples_from_merged_weights_when_asked():
    from lit_rl.rollout import HFGenerate
    from lit_rl.rollout.base import SamplingParams
    from lit_rl.rollout.engines.hf import HFGenerateEngine

    model = perturbed_lora_model().to(torch.bfloat16)  # bf16: merging rounds the adapter's delta into W
    prompts = torch.randint(3, 256, (4, 6))
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    adapter = HFGenerateEngine(model, eos_token_ids=[0], pad_token_id=0)
    merged = HFGenerateEngine(model, eos_token_ids=[0], pad_token_id=0, merged_lora=True)
    a = adapter.generate(prompts, torch.ones_like(prompts), params, seeds=[1, 2, 3, 4])
    b = merged.generate(prompts, torch.ones_like(prompts), params, seeds=[1, 2, 3, 4])
    c = adapter.generate(prompts, torch.ones_like(prompts), params, seeds=[1, 2, 3, 4])
    assert not torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.completion_ids, c.completion_ids) and torch.equal(a.logprobs, c.logprobs)  # restored
    with pytest.raises(ConfigError, match=r"model\.rollout\.engine\.lora_weights must be one of"):
        HFGenerate(lora_weights="fused")


@pytest.mark.parametrize(
    "config, key",
    [
        (dict(r=0), "model.policy.lora.r"),
        (dict(alpha=0.0), "model.policy.lora.alpha"),
        (dict(dropout=1.0), "model.policy.lora.dropout"),
        (dict(bias="some"), "model.policy.lora.bias"),
        (dict(target_modules=[]), "model.policy.lora.target_modules"),
    ],
)
def test_bad_settings_are_rejected_by_name(config, key):
    with pytest.raises(ConfigError, match=key):
        GRPO(**grouped_kwargs(GRPO, lora=LoRAConfig(**config)))


def test_settings_that_would_corrupt_the_numbers_are_rejected():
    with pytest.raises(ConfigError, match="model.policy.lora.dropout must be 0 for GRPO"):
        GRPO(**grouped_kwargs(GRPO, lora=LoRAConfig(dropout=0.1)))
    SFT(**grouped_kwargs(SFT, model_name_or_path=SFT_MODEL, lora=LoRAConfig(dropout=0.1)))  # SFT keeps dropout: allowed
    with pytest.raises(ConfigError, match="model.policy.lora with model.random_init"):
        SFT(**grouped_kwargs(SFT, random_init=True, lora=LoRAConfig()))
    module = GRPO(**grouped_kwargs(GRPO, beta=0.1, lora=LoRAConfig(bias="all")))
    with pytest.raises(ConfigError, match="model.policy.lora.bias='all' trains biases"):
        module.configure_model()
    # The tiny model ties its embeddings: adapting the head alone would untie them (and vLLM would tie them back).
    with pytest.raises(ConfigError, match=r"model.policy.lora names \['lm_head'\].*tie_word_embeddings"):
        GRPO(**grouped_kwargs(GRPO, lora=LoRAConfig(modules_to_save=["lm_head"]))).configure_model()


def test_resuming_across_lora_and_full_training_is_refused():
    module = DPO(**grouped_kwargs(DPO, lora=LoRAConfig(r=4)))
    module.configure_model()
    with pytest.raises(ConfigError, match="trained without model.policy.lora"):
        module.on_load_checkpoint({"hyper_parameters": {"lora": None}, "state_dict": {}})


def test_unknown_target_module_names_the_key():
    module = GRPO(**grouped_kwargs(GRPO, lora=LoRAConfig(target_modules=["no_such_proj"])))
    with pytest.raises(ConfigError, match=r"model.policy.lora.target_modules=\['no_such_proj'\]"):
        module.configure_model()


def test_grpo_with_lora_trains_the_adapter_only_and_loads_no_reference_copy():
    model = fit_grpo(beta=0.1, num_iterations=2, steps_per_generation=2, lora=LoRAConfig(r=4))
    assert model.ref_model is None  # the reference is the policy with its adapter disabled
    buffer = model._buffer
    tokens = buffer.completion_mask > 0
    # Generated before any update: the adapter (B = 0) changes nothing yet, so reference = old log-probs.
    assert (buffer.ref_logprobs - buffer.old_logprobs).abs()[tokens].max() < 1e-5
    trained = trainable_keys(model.policy)
    assert trained and all(".lora_" in name for name in trained)
    optimized = sum(p.numel() for group in model.trainer.optimizers[0].param_groups for p in group["params"])
    assert optimized == sum(p.numel() for n, p in model.policy.named_parameters() if n in trained)
    plain = load_causal_lm(SFT_MODEL).state_dict()
    now = model.policy.get_base_model().state_dict()
    assert torch.equal(now["model.embed_tokens.weight"], plain["model.embed_tokens.weight"])
    base = now["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert torch.equal(base, plain["model.layers.0.self_attn.q_proj.weight"])  # frozen weights did not move
    merged = dict(merged_weights(model.policy))
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter did


@pytest.mark.parametrize("module_class", [GRPO, DPO])
def test_checkpoint_state_holds_the_adapter_only_and_loads_strictly(module_class):
    module = module_class(**grouped_kwargs(module_class, lora=LoRAConfig(r=4)))
    module.configure_model()
    full_state = module.state_dict()
    checkpoint = {"state_dict": dict(full_state), "hyper_parameters": dict(module.hparams)}
    PolicyModule.on_save_checkpoint(module, checkpoint)  # the hook that filters weights (no trainer needed)
    kept = set(checkpoint["state_dict"])
    assert kept and all(".lora_" in key for key in kept)
    assert sum(v.numel() for v in checkpoint["state_dict"].values()) < 0.25 * sum(
        v.numel() for k, v in full_state.items() if k.startswith("policy.")
    )
    restored = module_class(**grouped_kwargs(module_class, lora=LoRAConfig(r=4)))
    restored.configure_model()
    with torch.no_grad():
        for key, value in checkpoint["state_dict"].items():
            value.add_(1.0)  # make the saved adapter differ from the fresh one
    PolicyModule.on_load_checkpoint(restored, checkpoint)
    restored.load_state_dict(checkpoint["state_dict"], strict=True)
    for key, value in restored.state_dict().items():
        expected = checkpoint["state_dict"][key]
        assert torch.equal(value, expected), key


def test_adapters_learn_under_gradient_checkpointing():
    # The embeddings are frozen; checkpointed blocks must still pass gradients to the adapters inside them.
    lora = LoRAConfig(r=4)
    model = fit_grpo(steps_per_generation=2, gradient_checkpointing=True, learning_rate=1e-2, lora=lora)
    lora_b = [p for name, p in model.policy.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at 0; every one of them moved
