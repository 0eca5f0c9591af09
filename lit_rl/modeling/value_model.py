"""PPO's critic: a causal LM's decoder with a one-output linear head, V(s_t) at every position.

The layout is Hugging Face's token-classification model with one label (`model.*`, the decoder; `score.*`, the
head), so a trained critic exports as `AutoModelForTokenClassification` (`save_value_model`). It answers the calls
the policy's forward paths make (`lit_rl.modeling.completions.completion_forward`: padded, shared-prompt and packed)
with the values as one-wide "logits": `completion_forward(critic, ...)[..., 0]` is V [N, T] at the positions that
predict the completion tokens, i.e. the value of the state before each token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lit_rl.modeling.models import load_causal_lm, reading_model, resolve_model_path
from lit_rl.training.strategies import gathered_parameters_of


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


VALUE_HEAD_FILE = "value_head.safetensors"  # the head, beside a decoder's own directory (`save_value_state`)


def _scorer_class(config: Any) -> Optional[Any]:
    """The auto class of a saved one-output scorer (a critic exported as token classification, or a reward model:
    sequence classification), or None for any other model."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    architectures = getattr(config, "architectures", None) or []
    if getattr(config, "num_labels", None) != 1:
        return None
    if any(name.endswith("ForTokenClassification") for name in architectures):
        return AutoModelForTokenClassification
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return AutoModelForSequenceClassification
    return None


def load_value_model(
    name_or_path: str,
    num_embeddings: int,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: Optional[str] = None,
) -> ValueModel:
    """A critic from the model at `name_or_path`, dropout off, embeddings resized to `num_embeddings` when the
    tokenizer gained a pad token:

    - a one-label token- or sequence-classification model (an exported critic, a reward model): its decoder and
      its head;
    - a decoder directory with `value_head.safetensors` (`save_value_state`'s layout for architectures without a
      token-classification class): both;
    - a causal LM: its decoder and a new head whose weights and bias are 0, so every value starts at 0 whatever
      the seed (`set_value_head`, also where parameters are partitioned).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel

    resolved = resolve_model_path(name_or_path)
    with reading_model(name_or_path, resolved):
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    head_file = Path(resolved) / VALUE_HEAD_FILE
    scorer = _scorer_class(config)
    options = dict(
        dtype=dtype,
        gradient_checkpointing=gradient_checkpointing,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )
    head: Optional[dict[str, torch.Tensor]] = None
    if scorer is not None:
        model = load_causal_lm(name_or_path, disable_dropout=True, auto_class=scorer, **options)
        decoder = model.base_model
        with gathered_parameters_of(list(model.score.parameters())):  # whole under ZeRO-3 (read, not written)
            head = {name: value.detach().clone() for name, value in model.score.named_parameters()}
    elif head_file.exists():
        decoder = load_causal_lm(name_or_path, disable_dropout=True, auto_class=AutoModel, **options)
        head = load_file(head_file)
    else:
        decoder = load_causal_lm(name_or_path, disable_dropout=True, **options).get_decoder()
    if num_embeddings > decoder.get_input_embeddings().num_embeddings:
        decoder.resize_token_embeddings(num_embeddings)
    critic = ValueModel(decoder)
    set_value_head(critic, head)
    return critic


@torch.no_grad()
def set_value_head(critic: ValueModel, head: Optional[dict[str, torch.Tensor]]) -> None:
    """The head's weight and bias: `head`'s (a trained critic's, a reward model's; no bias: 0), else 0, so that every
    value starts at 0. Under ZeRO-3 the head was partitioned as it was created: written whole, by rank 0, and
    partitioned back (a collective there: every rank calls it)."""
    with gathered_parameters_of(list(critic.score.parameters()), modifier_rank=0):
        critic.score.weight.zero_()
        critic.score.bias.zero_()
        if head is not None:
            critic.score.weight.copy_(head["weight"].reshape(1, -1))
            if "bias" in head:
                critic.score.bias.copy_(head["bias"].reshape(1))


def save_value_model(critic: ValueModel, out_dir: str | Path) -> Path:
    """Write the critic with `save_pretrained` (`save_value_state`)."""
    return save_value_state(critic.config, critic.state_dict(), out_dir)


def save_value_state(config: Any, state: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write a critic's state dict (`model.*`, `score.*`) to `out_dir`: as Hugging Face's one-label
    `AutoModelForTokenClassification` where the architecture has one laid out as `model` + `score` (then
    `from_pretrained(out_dir)(ids).logits[..., 0]` are its values), else as the decoder's own `save_pretrained`
    directory (`AutoModel`) with the head in `value_head.safetensors`. `load_value_model` reads both."""
    import copy

    from safetensors.torch import save_file
    from transformers import AutoModel, AutoModelForTokenClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0  # trained without dropout
    dtype = state["score.weight"].dtype
    decoder_state = {key[len("model.") :]: value for key, value in state.items() if key.startswith("model.")}
    try:
        model = AutoModelForTokenClassification.from_config(config, dtype=dtype)
        if getattr(model, "base_model_prefix", None) != "model":
            raise ValueError("its decoder is not named `model`")
        _resize_like(model, state)
        model.load_state_dict(state, strict=True)
    except (ValueError, KeyError, RuntimeError):  # no token-classification class, or one laid out differently
        decoder = AutoModel.from_config(config, dtype=dtype)
        _resize_like(decoder, decoder_state)
        decoder.load_state_dict(decoder_state, strict=True)
        decoder.save_pretrained(out, safe_serialization=True)
        head = {"weight": state["score.weight"].contiguous(), "bias": state["score.bias"].contiguous()}
        save_file(head, str(out / VALUE_HEAD_FILE))
        return out
    model.save_pretrained(out, safe_serialization=True)
    return out


def _resize_like(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Resize `model`'s input embeddings to the vocabulary of its weights in `state` (training may have added a
    pad token)."""
    embeddings = model.get_input_embeddings()
    name = next(name for name, module in model.named_modules() if module is embeddings)
    weight = state.get(f"{name}.weight")
    if weight is not None and weight.shape[0] != embeddings.num_embeddings:
        model.resize_token_embeddings(weight.shape[0])
