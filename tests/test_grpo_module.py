"""GRPO internals through a plain Trainer: what is (not) computed, and what the rollout buffer holds."""

import lightning as L
import pytest
import torch

from tests.conftest import fit_grpo


def test_on_policy_single_pass_computes_no_old_logprobs_and_beta0_loads_no_reference():
    model = fit_grpo(beta=0.0, num_iterations=1, steps_per_generation=1)
    assert model.ref_model is None
    assert model._buffer.old_logprobs is None and model._buffer.ref_logprobs is None


def test_multiple_iterations_compute_old_logprobs_that_match_the_rollout():
    model = fit_grpo(beta=0.1, num_iterations=2, micro_batch_size=4, steps_per_generation=2)
    buffer = model._buffer
    assert model.ref_model is not None and not any(p.requires_grad for p in model.ref_model.parameters())
    tokens = buffer.completion_mask > 0
    assert (buffer.old_logprobs - buffer.rollout_logprobs).abs()[tokens].max() < 1e-5
    # The reference is the starting policy: before any update its log-probs equal the old ones.
    assert (buffer.ref_logprobs - buffer.old_logprobs).abs()[tokens].max() < 1e-5
    assert buffer.advantages.shape == buffer.rewards.shape == (8,)
    grouped = buffer.advantages.view(-1, 4)
    assert torch.allclose(grouped.sum(dim=1), torch.zeros(2), atol=1e-4)


def test_group_must_fit_in_a_generation_batch():
    with pytest.raises(ValueError, match="must be a multiple of model.sampling.num_generations=3"):
        fit_grpo(num_generations=3, micro_batch_size=4)


class CountingTokenizer:
    """Passes everything to a tokenizer and records the texts of each call."""

    def __init__(self, inner):
        self.__dict__.update(inner=inner, calls=[])

    def __call__(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def test_encode_prompts_tokenizes_each_distinct_prompt_once():
    """A rollout batch holds every prompt G times: the encoding must equal tokenizing every row, from one
    tokenizer call over the distinct prompts (chat prompts included)."""
    from lit_rl.algorithms import GRPO

    module = GRPO()
    module.configure_model()
    chat = [{"role": "user", "content": "45+67="}]
    prompts = ["1+2=", "9+99=", "1+2=", chat, "9+99=", [dict(m) for m in chat]]
    texts = [p if isinstance(p, str) else module.prompt_encoder.format(p) for p in prompts]
    module.tokenizer.padding_side = "left"
    expected = module.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    assert (expected["attention_mask"] == 0).any()  # padded: the rows differ in length
    counting = module.prompt_encoder.tokenizer = CountingTokenizer(module.tokenizer)  # the encoder's, shared
    ids, mask = module.prompt_encoder.encode(prompts)
    assert counting.calls == [["1+2=", "9+99=", texts[3]]]
    assert torch.equal(ids, expected["input_ids"])
    assert torch.equal(mask, expected["attention_mask"])
    # All text prompts: the tokenizer adds its special tokens, once per distinct prompt too.
    counting.calls.clear()
    texts = ["7+8=", "12+34=", "7+8="]
    ids, mask = module.prompt_encoder.encode(texts)
    assert counting.calls == [["7+8=", "12+34="]]
    expected = module.tokenizer(texts, padding=True, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"]) and torch.equal(mask, expected["attention_mask"])


class RecordLossAndGradient(L.Callback):
    """`training_step`'s returned loss, the gradient norm before the optimizer step, and the rollout buffer the
    step trained on."""

    def __init__(self):
        self.losses, self.grad_norms, self.buffers = [], [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.grad_norms.append(torch.cat(grads).norm().item())
        self.buffers.append(pl_module._buffer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def beta0_rounding_bound(rewards, advantages, group_size, completion_length, eps=1e-4):
    """Bound on |loss| for beta 0, one iteration, `sequence` aggregation, group-scaled advantages, float32.

    In exact arithmetic the loss is -mean_i(A_i) = 0 (each group's advantages sum to 0), while its gradient is
    -mean_i(A_i * mean_t grad logp_it). In float32 (unit roundoff u = 2^-24), with N sequences of at most T tokens:
    - the loss's reductions (T-token sums per sequence, N-sequence sum, two divisions) add at most
      (T + N + 3) u mean|A|;
    - the advantages sum to G (mean - fl(mean)) / (std + eps) per group plus 2u sum|A|, and the float32 mean of G
      rewards is within G u mean|r| of the exact one: at most G u mean_i(mean_g(i)|r| / (std_g(i) + eps)) + 2u
      mean|A| after dividing by N.
    So |loss| <= u [(T + N + 6) mean|A| + G mean_i(mean_g(i)|r| / (std_g(i) + eps))] (first order in u)."""
    u = 2.0**-24
    rewards, advantages = rewards.double(), advantages.double()
    grouped = rewards.view(-1, group_size)
    scale = (grouped.abs().mean(dim=1) / (grouped.std(dim=1) + eps)).repeat_interleave(group_size)
    N = len(advantages)
    return u * ((completion_length + N + 6) * advantages.abs().mean() + group_size * scale.mean()).item()


def test_beta0_one_iteration_sequence_loss_is_zero_to_rounding_through_training_step():
    """The invariant at module level: `training_step`'s loss is 0 within the float32 rounding bound, while the
    gradient it back-propagates is not."""
    record = RecordLossAndGradient()
    fit_grpo(max_steps=3, callbacks=[record], beta=0.0)
    assert len(record.losses) == len(record.grad_norms) == 3
    for loss, grad_norm, buffer in zip(record.losses, record.grad_norms, record.buffers, strict=True):
        assert buffer.advantages.abs().max() > 0.1  # rewards differ within groups: the gradient has a signal
        bound = beta0_rounding_bound(buffer.rewards, buffer.advantages, 4, buffer.completion_mask.shape[1])
        assert abs(loss) <= bound, (loss, bound)
        assert bound < 1e-4 and grad_norm > 1e-2


def test_the_loss_mask_is_built_once_with_the_batch_and_restored_for_a_buffer_saved_without_it(tmp_path):
    """The batch keeps the algorithm's loss mask (the overlong filter's here: truncated rows count nothing), and a
    rollout buffer checkpointed before it did (no `loss_mask`) gets it back when loaded."""
    model = fit_grpo(overlong_filter=True, num_iterations=2, steps_per_generation=2, max_new_tokens=3)
    buffer = model._buffer
    expected = model.loss_mask(buffer)
    assert torch.equal(buffer.loss_mask, expected)
    assert (expected.sum(dim=1) < buffer.completion_mask.sum(dim=1)).any()  # some rows cut off: the filter bites
    model.trainer.save_checkpoint(tmp_path / "mid_generation.ckpt")
    checkpoint = torch.load(tmp_path / "mid_generation.ckpt", weights_only=False)
    saved = checkpoint["lit_rl"]["per_rank"][0]["buffer"]
    assert torch.equal(saved["loss_mask"], expected)
    del saved["loss_mask"]  # as an earlier lit-rl wrote it
    model.on_load_checkpoint(checkpoint)
    assert torch.equal(model._buffer.loss_mask, expected)
