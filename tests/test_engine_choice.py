"""`model.rollout.engine` is a choice of typed configs (`lit_rl.rollout.engine_config`): lit-rl's three engines by
name, a user's by import path (trained with here, from a module outside the package), 0.1's `model.vllm` mapped
to its engine, and a checkpoint that keeps the choice as plain data and imports no code from it."""

from __future__ import annotations

import sys
import textwrap

import pytest

from lit_rl.algorithms import GRPO, PPO, RLOO, OnlineDPO
from lit_rl.config import RolloutArgs, grouped_hparams, plain_data
from lit_rl.errors import ConfigError
from lit_rl.rollout import HFGenerate, VLLMColocate, VLLMServer, WeightTransfer
from lit_rl.rollout.engine_config import engine_from_config, engine_of_0_1
from tests.conftest import FAST_GRPO, fit_config, train_rows

EXTERNAL_ENGINE = '''
from pathlib import Path

from lit_rl.rollout import EngineConfig, HFGenerate


class CountingEngine(EngineConfig):
    """HF `generate`, writing one line per rollout call to `count_file`."""

    def __init__(self, count_file: str = "rollouts.txt") -> None:
        self.count_file = count_file

    def build(self, module):
        inner, path = HFGenerate().build(module), Path(self.count_file)

        class Counting:
            needs_weights = inner.needs_weights

            def generate(self, *args, **kwargs):
                with path.open("a") as out:
                    out.write(f"{module.training}\\n")
                return inner.generate(*args, **kwargs)

            def update_weights(self, named_tensors=None):
                inner.update_weights(named_tensors)

            def close(self):
                inner.close()

        return Counting()

    def numerics_differ(self, compute_dtype):
        return False
'''


def test_an_engine_from_outside_the_package_trains_by_its_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_engines.py").write_text(textwrap.dedent(EXTERNAL_ENGINE))
    monkeypatch.syspath_prepend(str(tmp_path))
    count = tmp_path / "rollouts.txt"
    engine = ["--model.rollout.engine", "my_engines.CountingEngine", "--model.rollout.engine.count_file", str(count)]
    log_dir = fit_config(tmp_path, "external", "grpo.yaml", *FAST_GRPO, "--trainer.max_steps", "2", *engine)
    assert [row["step"] for row in train_rows(log_dir)] == [1, 2]
    calls = count.read_text().split()
    assert calls.count("True") == 2  # one training generation per optimizer step, sampled by this engine
    sys.modules.pop("my_engines", None)


def test_lit_rl_s_engines_are_chosen_by_name_and_keep_their_options():
    assert GRPO().engine_config == HFGenerate()  # the same class, with the same options
    assert RolloutArgs().engine is None and RolloutArgs().engine_config == HFGenerate()
    colocated = GRPO(rollout=RolloutArgs(engine=VLLMColocate(gpu_memory_utilization=0.5)))
    engine = colocated.engine_config  # what the colocated engine reads
    assert isinstance(engine, VLLMColocate) and engine.gpu_memory_utilization == 0.5
    server = VLLMServer(server_url="http://127.0.0.1:9000", transfer=WeightTransfer(method="gloo", port=29600))
    module = GRPO(rollout=RolloutArgs(engine=server, max_staleness=1))
    assert isinstance(module.engine_config, VLLMServer) and module.max_staleness == 1
    assert (module.engine_config.transfer.method, module.engine_config.transfer.port) == ("gloo", 29600)


def test_a_checkpoint_keeps_the_choice_as_data_and_imports_no_code_from_it():
    saved = plain_data(RolloutArgs(engine=VLLMServer(server_url="http://127.0.0.1:9000")))
    assert saved["engine"]["class_path"] == "lit_rl.rollout.VLLMServer"
    assert saved["engine"]["init_args"]["server_url"] == "http://127.0.0.1:9000"
    assert RolloutArgs(**saved).engine == VLLMServer(server_url="http://127.0.0.1:9000")  # load_from_checkpoint
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine: my_engines\.CountingEngine is not one of"):
        engine_from_config({"class_path": "my_engines.CountingEngine", "init_args": {}})
    with pytest.raises(ConfigError, match=r"model\.rollout\.engine\.transfer\.porte: unknown option"):
        VLLMServer(transfer={"porte": 1})


def test_0_1_vllm_settings_become_the_engine_they_meant():
    assert engine_of_0_1(None) == {
        "class_path": "lit_rl.rollout.HFGenerate",
        "init_args": {"lora_weights": "adapter", "compile": False, "gather_weights": True},
    }
    server = engine_of_0_1({"mode": "server", "server_url": "http://h:1", "weight_transfer": "gloo", "dtype": "auto"})
    assert server == {
        "class_path": "lit_rl.rollout.VLLMServer",
        "init_args": {"server_url": "http://h:1", "dtype": "auto", "transfer": {"method": "gloo"}},
    }
    colocated = engine_of_0_1({"mode": "colocate", "gpu_memory_utilization": 0.4, "server_url": "http://unused:1"})
    assert colocated == {"class_path": "lit_rl.rollout.VLLMColocate", "init_args": {"gpu_memory_utilization": 0.4}}
    # A 0.1 checkpoint's flat keys and a 0.1 `VLLMConfig` made in Python (here the mapping of its fields, the other
    # mode's too, as `vars` gave it) land in the same place.
    grouped = grouped_hparams({"vllm": {"mode": "server"}, "max_staleness": 2})
    assert grouped == {"rollout": {"engine": VLLMServer().as_config(), "max_staleness": 2}}
    assert grouped_hparams({"vllm": None}) == {"rollout": {"engine": None}}  # HF generate, as 0.2 writes it
    every_field = {
        "mode": "server",
        "dtype": "float32",
        "gpu_memory_utilization": 0.3,  # colocated only: left out
        "enable_sleep_mode": False,
        "server_url": "http://127.0.0.1:8000",
        "weight_transfer": "auto",
        "weight_sync_dir": None,
        "transfer_port": 0,
    }
    assert engine_from_config(engine_of_0_1(every_field)).dtype == "float32"
    assert engine_from_config(engine_of_0_1(every_field)) == VLLMServer(dtype="float32")


def test_each_engine_checks_its_options_naming_the_new_key():
    with pytest.raises(ConfigError, match=r"model\.rollout\.engine\.gpu_memory_utilization must be in \(0, 1\]"):
        GRPO(rollout=RolloutArgs(engine=VLLMColocate(gpu_memory_utilization=0.0)))
    with pytest.raises(ConfigError, match=r"model\.rollout\.engine\.transfer\.method: http needs"):
        GRPO(rollout=RolloutArgs(engine=VLLMServer(transfer=WeightTransfer(method="http"))))
    only = r"\(GRPO, PPO and RLOO only\)"
    with pytest.raises(ConfigError, match=r"model\.rollout\.correction: OnlineDPO does not take it " + only):
        OnlineDPO(rollout=RolloutArgs(correction="none"))
    assert RLOO(rollout=RolloutArgs(correction="none")).rollout_correction() == "none"
    ppo = PPO(rollout=RolloutArgs(engine=VLLMServer(), max_staleness=1, correction="sequence_mask"))
    assert ppo.rollout_correction() == "sequence_mask"


def test_a_saved_config_of_the_default_engine_parses_again(tmp_path, capsys):
    """The config LightningCLI writes beside every run (`config.yaml`) must read back: a default engine object
    would be written as a string jsonargparse cannot parse."""
    from tests.conftest import CONFIGS, run_cli

    for overlay in ([], ["--config", str(CONFIGS / "rollout" / "vllm_server.yaml")]):
        with pytest.raises(SystemExit):
            run_cli("fit", "--config", str(CONFIGS / "grpo.yaml"), *overlay, "--print_config")
        saved = tmp_path / "config.yaml"
        saved.write_text(capsys.readouterr().out)
        with pytest.raises(SystemExit) as parsed:
            run_cli("fit", "--config", str(saved), "--print_config")
        assert parsed.value.code in (0, None), capsys.readouterr().err
        assert capsys.readouterr().out == saved.read_text()


def test_resume_compares_the_engine_option_by_option_and_says_nothing_when_it_is_the_same():
    from lit_rl.resume_config import reconcile

    def hparams(engine):
        return {"rollout": RolloutArgs(engine=engine)}

    checkpoint = plain_data(hparams(VLLMServer(server_url="http://127.0.0.1:8000")))
    checkpoint["_class_path"] = "lit_rl.algorithms.GRPO"
    assert reconcile("fit", GRPO, hparams(VLLMServer(server_url="http://127.0.0.1:8000")), checkpoint, "c") == []
    (changed,) = reconcile("fit", GRPO, hparams(VLLMServer(server_url="http://127.0.0.1:9000")), checkpoint, "c")
    assert changed.key == "model.rollout.engine.init_args.server_url"
    default = plain_data(hparams(None)) | {"_class_path": "lit_rl.algorithms.GRPO"}
    assert reconcile("fit", GRPO, hparams(None), default, "c") == []
    # A 0.1 checkpoint's `vllm` compares as the engine it meant, every option filled in.
    old = {"_class_path": "lit_rl.algorithms.GRPO", "vllm": {"mode": "server", "server_url": "http://127.0.0.1:8000"}}
    assert reconcile("fit", GRPO, hparams(VLLMServer(server_url="http://127.0.0.1:8000")), old, "c") == []
    # An option added to the engine after the checkpoint was written compares as its default, not as a difference.
    for option in ("launch", "launch_args", "launch_timeout_s"):
        del checkpoint["rollout"]["engine"]["init_args"][option]
    assert reconcile("fit", GRPO, hparams(VLLMServer(server_url="http://127.0.0.1:8000")), checkpoint, "c") == []
    (launched,) = reconcile("fit", GRPO, hparams(VLLMServer(launch=True)), checkpoint, "c")
    assert launched.key == "model.rollout.engine.init_args.launch"
    assert (launched.this_run, launched.checkpoint) == (True, False)


def test_a_0_1_overlay_without_a_mode_keeps_its_server_and_says_what_it_leaves_out():
    from lit_rl.migrate import migrate_text
    from lit_rl.rollout.engine_config import dropped_0_1_options

    assert engine_of_0_1({"server_url": "http://h:1"})["class_path"] == "lit_rl.rollout.VLLMServer"
    assert dropped_0_1_options({"mode": "colocate", "server_url": "http://h:1", "dtype": "auto"}) == ["server_url"]
    warnings = []
    text = "model:\n  class_path: lit_rl.algorithms.GRPO\n  init_args:\n    vllm:\n      mode: colocate\n"
    migrate_text(text + "      server_url: http://h:1\n", warn=warnings.append)
    assert warnings == ["model.init_args.vllm.server_url left out: VLLMColocate does not take it"]
    with pytest.raises(ConfigError, match=r"model\.rollout\.engine\.porte: unknown option of VLLMServer"):
        engine_from_config({"class_path": "lit_rl.rollout.VLLMServer", "init_args": {"porte": 1}})


def test_hf_generate_is_rank_local_only_on_whole_weights_gathered_for_no_call():
    """`RankLocalEngine.rank_local` lets each rank take its own number of calls (`model.env.ready_batches` on several
    processes): never when the ranks decode in step (FSDP, ZeRO-3 through its partitions) or gather the weights for
    each call (ZeRO-3 with `gather_weights`), where a rank left out of a call would hang the others."""
    from contextlib import nullcontext

    import torch

    from lit_rl.rollout.base import RankLocalEngine
    from lit_rl.rollout.engines.hf import HFGenerateEngine

    model = torch.nn.Linear(1, 1)
    assert isinstance(HFGenerateEngine(model, 2, 0), RankLocalEngine)
    assert HFGenerateEngine(model, 2, 0).rank_local  # DDP, ZeRO-2: whole weights, nothing gathered
    assert not HFGenerateEngine(model, 2, 0, synced_ranks=True).rank_local
    assert not HFGenerateEngine(model, 2, 0, whole_weights=nullcontext).rank_local


def test_the_removed_vllm_config_names_the_config_classes_that_replace_it():
    # 0.2's VLLMConfig merged both vLLM engines' options; each engine now reads its own config class.
    with pytest.raises(ImportError, match="VLLMColocate and VLLMServer") as info:
        from lit_rl.rollout import VLLMConfig  # noqa: F401
    assert "\n" not in str(info.value)
