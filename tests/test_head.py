"""The output head in chunks of tokens (`model.policy.head_chunk_tokens`, `lit_rl.modeling.head`): the same log-probs,
statistics and gradients as the full logits (fp32, 1e-5 of each tensor's scale), with no saved or computed logits beyond
one chunk, and a model whose logits are more than its head refused."""

from __future__ import annotations

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.modeling.completions import completion_scores
from lit_rl.modeling.head import chunked_head_scores, scores_from_logits
from lit_rl.modeling.models import load_causal_lm
from tests.conftest import grouped_kwargs
from tests.test_packing import MODEL, assert_close_to_scale, tokenizer, variable_batch  # noqa: F401

EXTRAS = ("entropy", "mean_logit", "argmax")


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_scores_and_gradients_equal_the_full_logits(chunk):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(11, 16, generator=generator, requires_grad=True)
    ids = torch.randint(0, 50, (11,), generator=generator)
    weights = torch.linspace(-1.0, 2.0, 11)

    def run(score):
        head.zero_grad()
        hidden.grad = None
        scores = score()
        (scores.logprobs * weights).sum().backward()
        return scores, hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()

    full = run(lambda: scores_from_logits(head(hidden), ids, 0.7, EXTRAS))
    chunked = run(lambda: chunked_head_scores(head, hidden, ids, chunk, 0.7, EXTRAS))
    for name in ("logprobs", "entropy", "mean_logit"):
        torch.testing.assert_close(getattr(chunked[0], name), getattr(full[0], name), rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked[0].argmax, full[0].argmax)
    for value, reference, name in zip(chunked[1:], full[1:], ("hidden", "weight", "bias")):
        assert_close_to_scale(value, reference, 1e-5, name)
    assert full[0].entropy.min() > 0 and full[2].abs().max() > 0  # real numbers were compared


def test_no_logits_beyond_one_chunk_are_computed_or_kept_for_backward():
    torch.manual_seed(0)
    vocab, chunk = 50, 4
    head = torch.nn.Linear(8, vocab, bias=False)
    hidden = torch.randn(21, 8, requires_grad=True)
    ids = torch.randint(0, vocab, (21,))
    head_rows = []
    head.register_forward_hook(lambda module, args, out: head_rows.append(out.shape[0]))
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        scores = chunked_head_scores(head, hidden, ids, chunk, extras=("entropy",))
    forward_calls = len(head_rows)
    scores.logprobs.sum().backward()
    assert forward_calls == 6 and max(head_rows) == chunk  # ceil(21 / 4) chunks of at most 4 tokens
    assert len(head_rows) == 2 * forward_calls  # backward recomputed each chunk's logits
    assert saved and not any(vocab in shape for shape in saved)  # backward keeps hidden states and ids only
    assert hidden.grad.abs().sum() > 0


def test_a_rank_without_tokens_still_runs_the_head_in_forward_and_backward():
    # An empty micro-step (token budgets) or a rank with fewer chunks: the head runs (ZeRO-3 gathers its weight
    # in step with the other ranks) and gets a zero gradient (DDP expects one from every parameter).
    head = torch.nn.Linear(8, 30)
    hidden = torch.randn(0, 8, requires_grad=True)
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(out.shape[0]))
    scores = chunked_head_scores(head, hidden, torch.zeros(0, dtype=torch.long), 4, num_chunks=3)
    scores.logprobs.sum().backward()
    assert calls[:3] == [0, 0, 0] and scores.logprobs.shape == (0,)
    assert head.weight.grad is not None and head.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_completion_scores_with_head_chunks_equal_the_logits_path(tokenizer, padding_free):  # noqa: F811
    model = load_causal_lm(MODEL)
    batch = variable_batch(tokenizer)  # shared prompts, so the padded path runs its shared-prompt forward
    mask = batch[3]
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view_as(mask)

    def run(head_chunk_tokens):
        model.zero_grad()
        scores = completion_scores(
            model, *batch, 0.9, padding_free=padding_free, head_chunk_tokens=head_chunk_tokens, extras=EXTRAS
        )
        (scores.logprobs * mask * weights).sum().backward()
        return scores, {n: p.grad.clone() for n, p in model.named_parameters()}

    full, full_grads = run(None)
    chunked, chunked_grads = run(5)
    tokens = mask > 0
    for name in ("logprobs", "entropy", "mean_logit"):
        torch.testing.assert_close(getattr(chunked, name)[tokens], getattr(full, name)[tokens], rtol=1e-5, atol=1e-5)
    assert torch.equal(chunked.argmax[tokens], full.argmax[tokens])
    assert (chunked.logprobs[~tokens] == 0).all()
    for name, grad in chunked_grads.items():
        assert_close_to_scale(grad, full_grads[name], 1e-5, name)
    assert full.logprobs[tokens].min() < -1  # real log-probs were compared


class SoftCapped(torch.nn.Module):
    """A model whose logits are soft-capped after the head (as Gemma 2's are)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def get_decoder(self):
        return self.inner.get_decoder()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = 5.0 * torch.tanh(out.logits / 5.0)
        return out


def test_a_model_whose_logits_are_more_than_its_head_is_refused(tokenizer):  # noqa: F811
    model = load_causal_lm(MODEL)
    batch = variable_batch(tokenizer)
    with pytest.raises(
        ConfigError, match="model.policy.head_chunk_tokens: SoftCapped's logits are not its output head"
    ):
        completion_scores(SoftCapped(model), *batch, head_chunk_tokens=4)
    completion_scores(model, *batch, head_chunk_tokens=4)  # the plain model passes
    assert model._lit_rl_plain_head


def test_head_chunks_are_refused_under_fsdp_before_the_model_is_built():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from lit_rl.algorithms import SFT

    module = SFT(**grouped_kwargs(SFT, model_name_or_path=MODEL, head_chunk_tokens=8))
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ConfigError, match="model.policy.head_chunk_tokens is not supported with FSDP yet"):
        module.configure_model()
    assert module.policy is None


def test_the_head_check_runs_without_dropout_and_leaves_the_training_mode(tokenizer):  # noqa: F811
    model = load_causal_lm(MODEL)
    for layer in model.get_decoder().layers:  # SFT keeps dropout: the two forwards of the check must not differ
        layer.self_attn.attention_dropout = 0.9
    model.train()
    completion_scores(model, *variable_batch(tokenizer), head_chunk_tokens=4)
    assert model.training and model._lit_rl_plain_head
