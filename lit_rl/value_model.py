"""PPO's critic: a causal LM's decoder with a one-output linear head, V(s_t) at every position.

The layout is Hugging Face's token-classification model with one label (`model.*`, the decoder; `score.*`, the
head), so a trained critic exports as `AutoModelForTokenClassification` (`save_value_model`). It answers the calls
the policy's forward paths make (`lit_rl.algorithms.base.completion_forward`: padded, shared-prompt and packed)
with the values as one-wide "logits": `completion_forward(critic, ...)[..., 0]` is V [N, T] at the positions that
predict the completion tokens, i.e. the value of the state before each token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lit_rl.models import load_causal_lm


class ValueModel(torch.nn.Module):
    """`model` (a decoder, e.g. `Qwen2Model`) and `score` (Linear(hidden, 1)): values [N, L, 1] as `logits`."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.model = decoder
        hidden = decoder.config.get_text_config().hidden_size
        dtype = next(decoder.parameters()).dtype
        self.score = torch.nn.Linear(hidden, 1, bias=True, dtype=dtype)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.model, "is_gradient_checkpointing", False))

    def get_decoder(self) -> torch.nn.Module:
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
    ) -> CausalLMOutputWithPast:
        """The decoder on the inputs, then the head on the positions `logits_to_keep` names (Hugging Face's
        convention: an int k keeps the last k positions, 0 all of them; a tensor lists the positions)."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        values = self.score(out.last_hidden_state[:, keep])  # [N, K, 1]
        return CausalLMOutputWithPast(logits=values, past_key_values=out.past_key_values if use_cache else None)


def load_value_model(
    name_or_path: str,
    num_embeddings: int,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
) -> ValueModel:
    """A critic from the causal LM at `name_or_path`: its decoder (dropout off, embeddings resized to
    `num_embeddings` when the tokenizer gained a pad token) and a new head whose weights and bias are 0, so every
    value starts at 0 whatever the seed (initialise it with `reset_value_head` where parameters are partitioned)."""
    lm = load_causal_lm(
        name_or_path,
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        trust_remote_code=trust_remote_code,
        disable_dropout=True,
    )
    if num_embeddings > lm.get_input_embeddings().num_embeddings:
        lm.resize_token_embeddings(num_embeddings)
    critic = ValueModel(lm.get_decoder())
    reset_value_head(critic)
    return critic


@torch.no_grad()
def reset_value_head(critic: ValueModel) -> None:
    """The head's weight and bias set to 0 (values 0 at the start)."""
    critic.score.weight.zero_()
    critic.score.bias.zero_()


def save_value_model(critic: ValueModel, out_dir: str | Path) -> Path:
    """Write the critic as a Hugging Face `AutoModelForTokenClassification` (one label) with `save_pretrained`:
    `AutoModelForTokenClassification.from_pretrained(out_dir)(ids).logits[..., 0]` are its values."""
    return save_value_state(critic.config, critic.state_dict(), out_dir)


def save_value_state(config: Any, state: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """`save_value_model` from a decoder config and a critic's state dict (`model.*`, `score.*`)."""
    import copy

    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # trained without dropout
    dtype = state["score.weight"].dtype
    model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
    vocab = state["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in state else None
    if vocab is not None and vocab != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab)
    model.load_state_dict(state, strict=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out
