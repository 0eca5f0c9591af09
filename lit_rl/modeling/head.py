"""The LM head in chunks of tokens: per-token log-probs without the `[tokens, vocab]` logits.

At a large vocabulary the logits dominate a training step's memory: 8 completions of 1024 tokens at Qwen2's
151,936 entries are 5 GiB of float32 logits, and their log-softmax and gradient as much again each, while the
21M-parameter model's own activations are a few MiB. With `model.policy.head_chunk_tokens: k` the decoder's last hidden
states of the completion tokens, `[K, H]`, go through the head `k` tokens at a time. Each chunk computes

    logprob_t = z_t[y_t] - logsumexp_v z_t[v],    z_t = head(h_t) / temperature

and keeps only `[k]` numbers; under autograd each chunk is checkpointed (`torch.utils.checkpoint`, non-reentrant),
so backward recomputes that chunk's logits and frees them before the next. Peak extra memory is one chunk's
logits a few times over, whatever the batch; the price is one more head forward per training token (the head's
matmul is the same arithmetic, so log-probs agree with the full-logits path to float rounding; a test checks
values and gradients). The statistics that metrics need (entropy, mean logit, argmax) come from the same chunk in
its first pass, without gradients.

Only completion tokens (where the mask is 1) reach the head, so the padded forward stops computing logits of
padding too. The head is the model's `get_output_embeddings()` applied to `get_decoder()`'s last hidden state, as
Llama, Qwen and Mistral compute their logits; `check_plain_head` refuses a model whose logits are anything more
(soft-capping, scaling). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from lit_rl.errors import ConfigError
from lit_rl.ops import entropy_from_logits, token_logprobs

EXTRAS = ("entropy", "mean_logit", "argmax")  # per-token statistics a caller may ask for besides log-probs


@dataclass
class TokenScores:
    """Per-token scores of completion tokens, each [N, T] (or [K] before `scatter`)."""

    logprobs: torch.Tensor  # log p(token) under softmax(logits / temperature), float32, differentiable
    entropy: Optional[torch.Tensor] = None  # -sum_v p_v log p_v of the same distribution, detached
    mean_logit: Optional[torch.Tensor] = None  # the raw logits' mean over the vocabulary, detached
    argmax: Optional[torch.Tensor] = None  # the most likely token id

    def scatter(self, rows: torch.Tensor, columns: torch.Tensor, shape: tuple[int, int]) -> "TokenScores":
        """[K] scores at (rows, columns) -> [N, T], zero elsewhere."""

        def place(values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if values is None:
                return None
            return values.new_zeros(shape).index_put((rows, columns), values)

        return TokenScores(*(place(v) for v in (self.logprobs, self.entropy, self.mean_logit, self.argmax)))


def check_extras(extras: tuple[str, ...]) -> None:
    unknown = set(extras) - set(EXTRAS)
    if unknown:
        raise ValueError(f"unknown token statistics {sorted(unknown)}; known: {list(EXTRAS)}")


def scores_from_logits(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, extras: tuple[str, ...] = ()
) -> TokenScores:
    """`TokenScores` of `token_ids` [...] from full logits [..., V] (the unchunked path)."""
    check_extras(extras)
    detached = logits.detach()
    return TokenScores(
        token_logprobs(logits, token_ids, temperature),
        entropy_from_logits(detached, temperature) if "entropy" in extras else None,
        detached.float().mean(dim=-1) if "mean_logit" in extras else None,
        detached.argmax(dim=-1) if "argmax" in extras else None,
    )


def _chunk_statistics(z: torch.Tensor, logsumexp: torch.Tensor, raw: torch.Tensor, extras: tuple[str, ...]) -> dict:
    """Entropy, mean logit and argmax of one chunk from its tempered logits `z` [k, V] and their logsumexp [k]."""
    stats = {}
    if "entropy" in extras:
        logp = z - logsumexp[:, None]
        stats["entropy"] = -(logp.exp() * logp).sum(dim=-1)
    if "mean_logit" in extras:
        stats["mean_logit"] = raw.mean(dim=-1)
    if "argmax" in extras:
        stats["argmax"] = raw.argmax(dim=-1)
    return stats


def chunked_head_scores(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    chunk_tokens: int,
    temperature: float = 1.0,
    extras: tuple[str, ...] = (),
    num_chunks: Optional[int] = None,
) -> TokenScores:
    """`TokenScores` [K] of `token_ids` [K] from the last hidden states `hidden` [K, H], `chunk_tokens` at a time
    (`num_chunks` calls of the head if that is more: the surplus ones on no tokens).

    With gradients enabled each chunk is a checkpoint: its forward keeps `[k]` log-probs, its backward recomputes
    the chunk's logits. The statistics in `extras` are taken in the first pass only (the recomputation skips them).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    check_extras(extras)
    pieces: list[torch.Tensor] = []
    stats: dict[str, list[torch.Tensor]] = {name: [] for name in extras}
    track = torch.is_grad_enabled() and hidden.requires_grad

    def chunk_logprobs(h: torch.Tensor, ids: torch.Tensor, first_pass: list[bool]) -> torch.Tensor:
        raw = head(h).float()  # [k, V]
        z = raw / temperature if temperature != 1.0 else raw
        logsumexp = torch.logsumexp(z, dim=-1)  # [k]
        logprobs = z.gather(-1, ids[:, None]).squeeze(-1) - logsumexp
        if first_pass[0]:  # not again when backward recomputes the chunk
            first_pass[0] = False
            with torch.no_grad():
                for name, value in _chunk_statistics(z.detach(), logsumexp.detach(), raw.detach(), extras).items():
                    stats[name].append(value)
        return logprobs

    # At least one chunk, so the head takes part in every backward (DDP expects each parameter's gradient), and
    # `num_chunks` where ranks must call the head equally often (ZeRO-3 gathers its weight at every call).
    chunks = max(num_chunks or 0, -(-hidden.shape[0] // chunk_tokens), 1)
    for index in range(chunks):
        start = index * chunk_tokens
        h, ids = hidden[start : start + chunk_tokens], token_ids[start : start + chunk_tokens]
        if track:
            # The head draws no random numbers: no RNG state to save and restore around each chunk.
            pieces.append(checkpoint(chunk_logprobs, h, ids, [True], use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(chunk_logprobs(h, ids, [True]))
    joined = {name: torch.cat(values) for name, values in stats.items()}
    return TokenScores(torch.cat(pieces), joined.get("entropy"), joined.get("mean_logit"), joined.get("argmax"))


def check_plain_head(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse a model whose logits are more than `get_output_embeddings()(get_decoder()(...).last_hidden_state)`:
    checked once per model on four tokens (every rank runs it, so sharded parameters gather in step)."""
    if getattr(model, "_lit_rl_plain_head", False):
        return
    name = type(model).__name__
    if not (callable(getattr(model, "get_decoder", None)) and callable(getattr(model, "get_output_embeddings", None))):
        raise ConfigError(
            f"model.policy.head_chunk_tokens: {name} has no get_decoder/get_output_embeddings; drop the option"
        )
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or head is None:
        raise ConfigError(f"model.policy.head_chunk_tokens: {name} exposes no decoder or output head; drop the option")
    ids = torch.arange(4, device=device)[None]
    was_training = model.training
    model.eval()  # dropout (SFT keeps it) would make the two forwards differ, and differ across ranks
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits.float()
            via_head = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    scale = logits.abs().max().clamp(min=1.0)
    if via_head.shape != logits.shape or (via_head - logits).abs().max() > 1e-4 * scale:
        raise ConfigError(
            f"model.policy.head_chunk_tokens: {name}'s logits are not its output head applied to the last hidden state "
            "(soft-capping or scaling after the head?); drop model.policy.head_chunk_tokens for this model"
        )
    model._lit_rl_plain_head = True
