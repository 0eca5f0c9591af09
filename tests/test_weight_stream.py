"""The bucketed weight stream (`lit_rl.rollout.weights`): the same weights as the whole state dict, in buckets that
never split a layer, gathered one bucket at a time."""

import json
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

from lit_rl.modeling.lora import merged_weights
from lit_rl.modeling.models import load_causal_lm
from lit_rl.rollout import weights as weights_module
from lit_rl.rollout.weights import buckets, plain_name, policy_weight_stream, weight_blocks
from tests.conftest import REPO, cli_env, perturbed_lora_model

SFT_MODEL = "lit-rl/tiny-qwen2-addition-sft"  # 4 decoder layers of 1,051,136 bytes; embeddings tied
LAYER_BYTES = 1_051_136


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(SFT_MODEL)


@pytest.fixture(scope="module")
def lora_model():
    return perturbed_lora_model(modules_to_save=["norm"])


@pytest.mark.parametrize(
    "bucket_bytes", [1, 300_000, 2 * LAYER_BYTES, 2**40], ids=["tiny", "sub-layer", "2-layers", "all"]
)
def test_the_stream_yields_the_state_dict_in_order(model, bucket_bytes):
    whole = list(model.state_dict().items())
    streamed = list(policy_weight_stream(model, bucket_bytes))
    assert [name for name, _ in streamed] == [name for name, _ in whole]  # tied lm_head.weight included
    for (name, expected), (_, value) in zip(whole, streamed, strict=True):
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("bucket_bytes", [300_000, 2**40])
def test_a_lora_policy_streams_its_merged_weights_under_the_plain_names(lora_model, bucket_bytes):
    merged = merged_weights(lora_model)
    streamed = list(policy_weight_stream(lora_model, bucket_bytes))
    assert [name for name, _ in streamed] == [name for name, _ in merged]
    assert not any("lora_" in name or "base_layer" in name for name, _ in streamed)
    for (name, expected), (_, value) in zip(merged, streamed, strict=True):
        assert torch.equal(value, expected), name
    q_proj = dict(streamed)["model.layers.0.self_attn.q_proj.weight"]
    base = lora_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(q_proj, base)  # the adapter's delta is in


def test_blocks_are_decoder_layers_and_modules_with_weights_of_their_own(model):
    blocks = weight_blocks(model)
    assert [(b.path, b.full_bytes) for b in blocks] == [
        ("model.embed_tokens", 320 * 128 * 4),
        *[(f"model.layers.{i}", LAYER_BYTES) for i in range(4)],
        ("model.norm", 128 * 4),
        ("lm_head", 320 * 128 * 4),  # tied to the embedding: gathered again in its own block
    ]


def test_buckets_hold_at_most_the_bound_unless_one_block_is_larger(model):
    blocks = weight_blocks(model)
    packed = buckets(blocks, 2 * LAYER_BYTES)
    assert [[b.path for b in bucket] for bucket in packed] == [
        ["model.embed_tokens", "model.layers.0"],
        ["model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.norm", "lm_head"],
    ]
    assert all(sum(b.full_bytes for b in bucket) <= 2 * LAYER_BYTES for bucket in packed)
    alone = buckets(blocks, 1000)  # every block larger than the bound but the norm: one bucket each
    assert [len(bucket) for bucket in alone] == [1, 1, 1, 1, 1, 1, 1]
    assert [b.path for bucket in packed for b in bucket] == [b.path for b in blocks]  # order kept, nothing lost


def test_one_bucket_is_gathered_at_a_time_and_its_tensors_are_read_inside(model, monkeypatch):
    """A fake gather (what ZeRO-3's GatheredParameters does) records which parameters are whole when: every
    tensor must be read while its bucket is gathered, and never two buckets at once."""
    state = {"open": None, "gathers": []}

    @contextmanager
    def fake_gather(params):
        assert state["open"] is None, "two buckets gathered at once"
        state["open"] = {id(p) for p in params}
        state["gathers"].append(sum(p.numel() * p.element_size() for p in params))
        yield
        state["open"] = None

    monkeypatch.setattr(weights_module, "gathered_parameters_of", fake_gather)
    owner = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    for name, _ in policy_weight_stream(model, 2 * LAYER_BYTES):
        assert owner[name] in state["open"], f"{name} was read outside its bucket's gather"
    assert state["gathers"] == [320 * 128 * 4 + LAYER_BYTES, 2 * LAYER_BYTES, LAYER_BYTES + 128 * 4 + 320 * 128 * 4]


def test_wrapper_segments_leave_the_names_and_flat_parameters_are_dropped():
    assert plain_name("model.layers.0._fsdp_wrapped_module.self_attn.q_proj.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert plain_name("_orig_mod.model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.1.mlp.up_proj.weight"
    )
    assert plain_name("model.layers.0._fsdp_wrapped_module._flat_param") is None


@pytest.mark.slow
def test_an_fsdp_sharded_policy_streams_the_plain_names_and_whole_weights():
    """Two CPU processes shard the model with FSDP. Gathered from the FSDP root (Lightning's wrapped module), the
    stream carries the plain model's names and weights; gathered from the policy alone, the weights the root's
    flat parameter holds (embeddings, final norm) would stay sharded."""
    script = REPO / "tests" / "integration" / "fsdp_stream_check.py"
    result = subprocess.run([sys.executable, str(script)], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    by_root = {r["root"]: r for r in map(json.loads, result.stdout.strip().splitlines())}
    assert by_root[True] == {"root": True, "names": True, "values": True}
    assert by_root[False]["names"] and not by_root[False]["values"]  # what gathering the policy alone misses
