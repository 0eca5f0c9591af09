"""Run as a script (vLLM needs the `__main__` guard): does a vLLM engine sample from the policy the trainer has?

    python tests/integration/vllm_logprob_check.py colocate
    python tests/integration/vllm_logprob_check.py server http://127.0.0.1:PORT
    python tests/integration/vllm_logprob_check.py colocate --lora
    python tests/integration/vllm_logprob_check.py colocate --full-and-lora
    python tests/integration/vllm_logprob_check.py server http://127.0.0.1:PORT --gloo

The engine starts from the shipped SFT policy's weights. The trainer's copy is then perturbed; completions sampled
before the push are scored by the trainer (their log-prob difference is large), the weights are pushed, and
completions sampled after it are scored again (the difference is rounding). With `--lora` the policy is the SFT
model with a LoRA adapter, and only the adapter is perturbed: the engine receives the merged weights. With
`--full-and-lora`, both run one after the other on the same engine (one engine start: the first push of each
policy syncs the engine), and the JSON holds each one's result by name.
Weights go through the training path (`policy_weight_stream`) in small buckets, so a push spans several buckets
(and the server engine writes several files, or with `--gloo` broadcasts several chunks to a server started with
`--weight-transfer-config '{"backend": "lit_rl_gloo"}'`). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

BUCKET_BYTES = 256 * 2**10  # below one decoder layer of the tiny model (1 MiB): a bucket per layer


def max_logprob_diff(engine, policy, prompt_ids, prompt_mask, params) -> tuple[float, int]:
    from lit_rl.modeling.completions import completion_scores

    out = engine.generate(prompt_ids, prompt_mask, params)
    trainer = completion_scores(
        policy, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, params.logprob_temperature
    ).logprobs
    diff = ((trainer - out.logprobs).abs() * out.completion_mask).max().item()
    return diff, int(out.completion_mask.sum())


# vLLM's Qwen2 fuses some of the Hugging Face projections into one parameter (rows stacked in this order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_parameters(worker) -> dict[str, torch.Tensor]:
    """Every parameter of the model a colocated vLLM worker runs (called on the worker by `collective_rpc`). On
    CPU, vLLM repacks each linear layer's weight for its GEMM kernel and leaves an empty parameter behind: that
    weight is read back through the layer's own kernel, as `linear(I, W) = W^T`."""
    model = worker.model_runner.model
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.numel() > 0}
    for name, module in model.named_modules():
        if hasattr(module, "cpu_linear") and module.weight.numel() == 0:
            identity = torch.eye(module.input_size_per_partition, dtype=torch.float32)
            weights[f"{name}.weight"] = module.cpu_linear(identity, module.weight, None).T.contiguous()
    return weights


def parameter_gap(engine, policy) -> dict[str, float]:
    """The largest |engine - policy| over every parameter of the colocated engine, with the policy's weights laid
    out as vLLM lays them out (fused projections, a tied head); how many engine parameters were compared (all of
    them), and which of the policy's tensors none of them covers (none: every weight was pushed)."""
    from lit_rl.modeling.lora import is_lora_model, merged_weights

    state = dict(merged_weights(policy)) if is_lora_model(policy) else policy.state_dict()
    (engine_state,) = engine.llm.collective_rpc(engine_parameters)
    gap, used = 0.0, set()
    for name, value in engine_state.items():
        fused = next((key for key in FUSED if f".{key}." in name), None)
        if fused:
            names = [name.replace(fused, part) for part in FUSED[fused]]
        elif name == "lm_head.weight" and name not in state:
            names = ["model.embed_tokens.weight"]  # tied to the embedding
        else:
            names = [name]
        expected = torch.cat([state[n] for n in names], dim=0)
        gap = max(gap, (value.float() - expected.float()).abs().max().item())
        used.update(names)
    tied = {"lm_head.weight"} if getattr(policy.config, "tie_word_embeddings", False) else set()
    return {
        "parameter_gap": gap,
        "parameters_compared": len(engine_state),
        "policy_tensors_not_in_engine": len(set(state) - used - tied),
    }


def main(mode: str, url: str | None, policies: list[str], gloo: bool = False) -> None:
    """Check each of `policies` (`full`, `lora`) on one engine; print its result, or all by name."""
    from lit_rl.modeling.models import load_tokenizer

    tokenizer = load_tokenizer(POLICY)
    engine = None
    results = {}
    for name in policies:
        policy = _policy(lora=name == "lora")
        if engine is None:
            engine = _engine(mode, url, policy, tokenizer, gloo)
        results[name] = check(engine, policy, tokenizer, mode)
    engine.close()
    print(json.dumps(results if len(policies) > 1 else results[policies[0]]))


POLICY = "lit-rl/tiny-qwen2-addition-sft"


def _policy(lora: bool):
    """The shipped SFT policy, or it with a LoRA adapter (rank 8, B = 0: the same function)."""
    from lit_rl.modeling.models import load_causal_lm

    policy = load_causal_lm(POLICY, dtype="float32").eval()
    if lora:
        from lit_rl.modeling.lora import LoRAConfig, apply_lora

        policy = apply_lora(policy, LoRAConfig(r=8)).eval()
    return policy


def _engine(mode: str, url: str | None, policy, tokenizer, gloo: bool):
    from lit_rl.modeling.models import model_eos_token_ids, resolve_model_path
    from lit_rl.rollout import VLLMColocate, VLLMServer, WeightTransfer

    eos_ids = model_eos_token_ids(policy, tokenizer.eos_token_id)
    if mode == "colocate":
        from lit_rl.rollout.engines.placement import EnginePlacement
        from lit_rl.rollout.engines.vllm import VLLMColocateEngine

        return VLLMColocateEngine.start(
            VLLMColocate(),
            resolve_model_path(POLICY),
            torch.float32,
            torch.device("cpu"),
            eos_ids,
            tokenizer.pad_token_id,
            placement=EnginePlacement(rank=0, local_rank=0, world_size=1, local_world_size=1),
        )
    from lit_rl.rollout.engines.vllm_server import VLLMServerEngine

    transfer = "gloo" if gloo else "auto"
    config = VLLMServer(server_url=url, push_bucket_mib=BUCKET_BYTES / 2**20, transfer=WeightTransfer(method=transfer))
    return VLLMServerEngine(config, eos_ids, tokenizer.pad_token_id)


def check(engine, policy, tokenizer, mode: str) -> dict:
    """Push `policy` (the engine then holds it), perturb it, and score completions sampled before and after a
    second push (module docstring)."""
    from lit_rl.rollout import SamplingParams
    from lit_rl.rollout.weights import policy_weight_stream

    engine.update_weights(policy_weight_stream(policy, BUCKET_BYTES))

    tokenizer.padding_side = "left"
    enc = tokenizer(["12+34=", "7+5=", "60+39=", "3+3="], padding=True, return_tensors="pt")
    prompt_ids = enc["input_ids"].repeat_interleave(4, dim=0)
    prompt_mask = enc["attention_mask"].repeat_interleave(4, dim=0)
    params = SamplingParams(max_new_tokens=6, temperature=0.8)

    torch.manual_seed(0)
    synced, _ = max_logprob_diff(engine, policy, prompt_ids, prompt_mask, params)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:  # everything, or with LoRA the adapter (whose B starts at 0)
                p.add_(torch.randn_like(p) * 0.05)
    before, _ = max_logprob_diff(engine, policy, prompt_ids, prompt_mask, params)
    engine.update_weights(policy_weight_stream(policy, BUCKET_BYTES))
    after, tokens = max_logprob_diff(engine, policy, prompt_ids, prompt_mask, params)
    result = {"synced": synced, "before_push": before, "after_push": after, "tokens": tokens}
    if mode == "colocate":  # the engine runs in this process: compare its parameters themselves
        result.update(parameter_gap(engine, policy))
    return result


if __name__ == "__main__":
    positional = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    url = positional[1] if len(positional) > 1 else None
    policies = ["full", "lora"] if "--full-and-lora" in sys.argv else ["lora" if "--lora" in sys.argv else "full"]
    main(positional[0], url, policies, gloo="--gloo" in sys.argv)
