"""benchmarks/soak.py: the growth it reports is computed from its samples as documented, and a short real run
samples every N steps of the demo config."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from soak import growth, markdown_table, process_resources  # noqa: E402


def _sample(step, rss, fds, threads):
    return {"step": step, "time_s": step / 10, "rss_mib": rss, "fds": fds, "threads": threads}


def test_growth_counts_from_the_warmup_sample_to_the_largest_after_it():
    samples = [_sample(0, 100, 10, 5), _sample(100, 200, 30, 9), _sample(200, 209, 30, 9), _sample(300, 205, 31, 8)]
    result = growth(samples, warmup=100)  # start-up (step 0 -> 100) does not count
    assert result["warmup_step"] == 100 and result["rss_mib_end"] == 205
    assert result["rss_growth"] == pytest.approx(9 / 200)  # the peak after warm-up, 209, not the last value
    assert result["fds_growth"] == 1 and result["threads_growth"] == 0
    assert not result["within_bounds"]  # one more descriptor open at the end than at warm-up
    assert growth(samples[:3], warmup=100)["within_bounds"]  # 4.5% RSS, no new descriptors or threads
    assert not growth([*samples[:2], _sample(200, 211, 30, 9)], warmup=100)["within_bounds"]  # 5.5% RSS
    with pytest.raises(ValueError, match="no sample after the warm-up"):
        growth(samples, warmup=300)


def test_process_resources_sees_a_new_descriptor():
    before = process_resources()
    with open(REPO / "README.md") as handle:
        assert process_resources()["fds"] == before["fds"] + 1
        handle.read(1)
    assert before["rss_mib"] > 0 and before["threads"] >= 1


@pytest.mark.slow
def test_a_short_soak_samples_every_n_steps(tmp_path):
    out = tmp_path / "soak.json"
    fast = [
        "--model.sampling.num_generations",
        "4",
        "--model.schedule.micro_batch_size",
        "8",
        "--model.sampling.max_new_tokens",
        "4",
    ]
    fast += ["--data.val_limit", "8", "--trainer.val_check_interval", "4"]
    command = [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--steps", "6", "--every", "2", "--warmup", "2"]
    result = subprocess.run(
        [*command, "--engines", "hf", "--out", str(out), "--", *fast], capture_output=True, text=True, timeout=600
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: a bound was exceeded, which 6 steps may do
    (run,) = json.loads(out.read_text())["results"]
    assert [s["step"] for s in run["samples"]] == [0, 2, 4, 6]
    assert run == {**run, **growth(run["samples"], warmup=2)}
    assert markdown_table([run]) in result.stdout
