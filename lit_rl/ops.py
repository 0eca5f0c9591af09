"""Numerical building blocks shared by every algorithm: per-token log-probs, masked means, entropy, KL.

Pure torch; no lightning, transformers or vllm imports.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24  # float32 elements per chunk (64 MiB): ~110 rows at the Qwen2 vocabulary of 151,936


def _rows_per_chunk(vocab: int, chunk_size: int | None) -> int:
    return chunk_size if chunk_size is not None else max(1, CHUNK_ELEMENTS // vocab)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-probability of `token_ids` under `softmax(logits / temperature)`.

    `logits` [..., V], `token_ids` [...] -> [...] (float32). Computes `logit[id] - logsumexp(logits)` over chunks
    of `chunk_size` rows (default: 64 MiB of float32 per chunk), so the peak extra memory is one chunk instead of a
    full float32 `[..., V]` log-softmax (`benchmarks/logprob_memory.py` measures it).
    """
    chunk_size = _rows_per_chunk(logits.shape[-1], chunk_size)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_ids = token_ids.reshape(-1)
    out = torch.empty(flat_ids.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_ids.shape[0], chunk_size):
        rows = flat_logits[start : start + chunk_size].float()
        if temperature != 1.0:
            rows = rows / temperature
        picked = rows.gather(-1, flat_ids[start : start + chunk_size, None]).squeeze(-1)
        out[start : start + chunk_size] = picked - torch.logsumexp(rows, dim=-1)
    return out.reshape(token_ids.shape)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy `-sum_v p_v log p_v` of `softmax(logits / temperature)`, [..., V] -> [...], chunked like above."""
    chunk_size = _rows_per_chunk(logits.shape[-1], chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        rows = flat[start : start + chunk_size].float() / temperature
        logp = torch.log_softmax(rows, dim=-1)
        out[start : start + chunk_size] = -(logp.exp() * logp).sum(-1)
    return out.reshape(logits.shape[:-1])


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """`sum(values * mask)` over `dim` (all dims when None)."""
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): `exp(ref - logp) - (ref - logp) - 1` (>= 0).

    Unbiased for KL under samples from the policy, low variance (Schulman, "Approximating KL divergence").
    Computed as `expm1(delta) - delta`: for log-prob differences near float32 rounding, `exp(delta) - 1` would
    cancel to noise (about 1e-8) where the value is about delta^2 / 2.
    """
    delta = ref_logprobs - logprobs
    return torch.expm1(delta) - delta


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them: [N, L] -> [N, L].

    Same formula as `transformers` generation, which keeps the trainer's forward equal to the sampler's.
    """
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)
