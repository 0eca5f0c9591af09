"""Multi-turn episodes (`lit_rl.rollout.multi_turn`), tools (`lit_rl.envs.tools`) and the loss mask of a
transcript, checked by hand on constructed episodes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from lit_rl.envs import SampledTurn, StepResult, TokenEnvironment, TokenIds, ToolEnvironment, calc
from lit_rl.envs.base import environment_factory
from lit_rl.envs.runner import EnvCallTimeout, EnvironmentRunner
from lit_rl.envs.tools import run_tool
from lit_rl.errors import ConfigError
from lit_rl.rollout import RolloutOutput, SamplingParams
from lit_rl.rollout.multi_turn import run_episodes, turn_seed
from lit_rl.types import EPISODE_STATS
from tests.conftest import fit_on_episodes

EOS, PAD = 9, 0


class ScriptedEngine:
    """Returns, for each call, the next scripted turn of each row (ids ending in EOS, log-prob -0.5 each), and
    records the contexts and seeds it was given."""

    needs_weights = False

    def __init__(self, turns: dict[int, list[list[int]]]) -> None:
        self.turns, self.calls = turns, []

    def generate(self, prompt_ids, prompt_mask, params, seeds=None):
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        self.calls.append((contexts, seeds, params.max_new_tokens))
        rows = [self.turns[context[0]].pop(0) for context in contexts]  # the first prompt id names the episode
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), PAD)
        mask = torch.zeros(len(rows), width)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return RolloutOutput(ids, mask, -0.5 * mask)


class Echo:
    """Observation `[7, 7]` (as text "obs") after every turn; done after `turns` turns; reward part `r` = 1 a turn."""

    reward_names = ("r",)

    def __init__(self, turns):
        self.turns, self.seen = turns, []

    def reset(self, row):
        return None

    def step(self, text):
        self.seen.append(text)
        done = len(self.seen) >= self.turns
        return StepResult(None if done else "obs", {"r": 1.0}, done, tool_calls=1, tool_errors=int(text == "bad"))


def _run(
    engine,
    envs,
    prompts,
    max_turns=4,
    max_total_tokens=100,
    max_new_tokens=8,
    seeds=(10, 20),
    runner=None,
    ended=(),
    schedule="lock-step",
):
    """`run_episodes` turn by turn (`schedule` "lock-step"), in batches of the turns that are ready ("ready"), or
    with each episode on its own after the first turn ("independent")."""
    return run_episodes(
        engine,
        envs,
        prompts,
        SamplingParams(max_new_tokens=max_new_tokens),
        list(seeds),
        decode=lambda ids: "bad" if ids == [3, EOS] else "ok",
        encode_observation=lambda observation, turn: [7, 7],
        reward_names=("r",),
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        pad_id=PAD,
        device=torch.device("cpu"),
        runner=runner or EnvironmentRunner(concurrency=4, timeout_s=10.0),
        ended=frozenset(ended),
        concurrent_generate=engine.generate if schedule == "independent" else None,
        ready_batches=schedule == "ready",
    )


SCHEDULES = pytest.mark.parametrize("schedule", ["lock-step", "ready", "independent"])


@SCHEDULES
def test_a_transcript_is_the_sampled_ids_and_the_observation_ids_laid_end_to_end(schedule):
    engine = ScriptedEngine({1: [[4, 5, EOS], [3, EOS]], 2: [[6, EOS], [8, 8, EOS]]})
    episodes = _run(engine, [Echo(2), Echo(2)], [[1, 1], [2]], schedule=schedule)
    out = episodes.output
    # Row 0: turn [4 5 EOS], observation [7 7], turn [3 EOS]; row 1: [6 EOS], [7 7], [8 8 EOS].
    assert out.completion_ids.tolist() == [[4, 5, EOS, 7, 7, 3, EOS], [6, EOS, 7, 7, 8, 8, EOS]]
    assert out.completion_mask.tolist() == [[1] * 7, [1] * 7]
    assert out.sampled_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1, 1]]
    assert out.logprobs.tolist() == [[-0.5, -0.5, -0.5, 0, 0, -0.5, -0.5], [-0.5, -0.5, 0, 0, -0.5, -0.5, -0.5]]
    # Turn 2 was sampled from the prompt's ids + turn 1's ids + the observation's ids, with the turn's own seed:
    # in one call turn by turn, in a call per episode when each goes on on its own, and in ready batches in one
    # call or two, as the steps' answers arrive.
    (first, first_seeds, _), *seconds = engine.calls
    assert first == [[1, 1], [2]] and first_seeds == [10, 20]
    second = sorted((context, seed) for contexts, seeds, _ in seconds for context, seed in zip(contexts, seeds))
    assert second == [([1, 1, 4, 5, EOS, 7, 7], turn_seed(10, 1)), ([2, 6, EOS, 7, 7], turn_seed(20, 1))]
    assert len(seconds) == {"lock-step": 1, "independent": 2}.get(schedule, len(seconds)) and turn_seed(10, 0) == 10
    assert episodes.env_rewards.tolist() == [[2.0], [2.0]]
    # turns, tool calls, tool errors (row 0's second turn decodes to "bad"), observation tokens, steps timed out
    assert episodes.stats.tolist() == [[2, 2, 1, 2, 0], [2, 2, 0, 2, 0]]


@SCHEDULES
def test_episodes_stop_at_max_turns_and_the_token_budget(schedule):
    engine = ScriptedEngine({1: [[4, 5, EOS], [3, EOS]], 2: [[6, 6, 6, 6, 6, EOS]]})
    run = dict(max_turns=2, max_total_tokens=4, seeds=(1, 2), schedule=schedule)
    episodes = _run(engine, [Echo(9), Echo(9)], [[1], [2]], **run)
    # Row 0: 3 tokens, then an observation cut to the 1 token left: the budget is spent, no second turn.
    # Row 1: its turn is cut to the budget of 4 tokens.
    assert episodes.output.completion_ids.tolist() == [[4, 5, EOS, 7], [6, 6, 6, 6]]
    assert episodes.output.sampled_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert [call[2] for call in engine.calls] == [4]  # one call, asking for at most the budget
    engine = ScriptedEngine({1: [[4, EOS], [3, EOS], [5, EOS]]})
    episodes = _run(engine, [Echo(9)], [[1]], max_turns=2, seeds=(1,), schedule=schedule)
    assert episodes.output.completion_ids.tolist() == [[4, EOS, 7, 7, 3, EOS]]  # no observation after the last turn
    assert episodes.stats[0, 0] == 2


def test_calc_computes_arithmetic_and_evaluates_nothing_else():
    assert calc("1234*5678") == "7006652" and calc("7/2") == "3.5" and calc("-(3+4)*2") == "-14" and calc("8/4") == "2"
    for bad in ['__import__("os").system("true")', "2**10", "a+1", "'x'*3", "[1]", "9" * 300]:
        with pytest.raises(ValueError):
            calc(bad)


def test_tool_calls_are_answered_and_failures_and_timeouts_are_observations():
    env = ToolEnvironment([calc], timeout_s=1.0)
    assert env.step("let me see <calc>12*34</calc>") == StepResult("<result>408</result>", tool_calls=1)
    assert env.step("408") == StepResult(None, done=True)
    failed = env.step("<calc>1/0</calc>")
    assert failed.observation == "<result>error: ZeroDivisionError: division by zero</result>" and failed.tool_errors
    assert env.step("<calc>os.system('x')</calc>").tool_errors == 1

    def slow(argument):
        time.sleep(2)
        return "late"

    start = time.monotonic()
    assert run_tool(slow, "", timeout_s=0.1) == ("error: timed out after 0.1 s", True)
    assert time.monotonic() - start < 1.0


def test_environment_settings_are_checked_with_one_line_errors():
    assert environment_factory(None, None, None) == (None, (), None, False, None)
    factory, names, schemas, raw_turns, routing = environment_factory(
        "tests.integration.envs.Countdown", {"turns": 2}, None
    )
    assert names == ("bonus",) and factory().turns == 2 and schemas is None and not raw_turns and routing is None
    with pytest.raises(ConfigError, match="model.env.environment: environment 'no.such.Env'"):
        environment_factory("no.such.Env", None, None)
    with pytest.raises(ConfigError, match="model.env.environment tests.integration.envs.Countdown: .*unexpected"):
        environment_factory("tests.integration.envs.Countdown", {"steps": 2}, None)
    with pytest.raises(ConfigError, match="model.env.tools: tool 'lit_rl.envs.tools.nothing'"):
        environment_factory(None, None, ["lit_rl.envs.tools.nothing"])
    with pytest.raises(ConfigError, match="model.env.environment_args is set but model.env.environment is not"):
        environment_factory(None, {"turns": 2}, None)


def test_only_the_models_tokens_carry_loss_and_token_metrics():
    """A GRPO step on Countdown episodes (up to 3 model turns, observations between): the loss's gradient is 0 at
    every observation token and not at the model's, whose log-probs under the trainer are the engine's."""
    model, observations = fit_on_episodes(beta=0.1)
    buffer = model._buffer
    torch.testing.assert_close(buffer.loss_mask, buffer.completion_mask * buffer.sampled_mask)
    assert (buffer.rollout_logprobs[observations] == 0).all()
    buffer.advantages = torch.linspace(-1.0, 1.0, len(buffer))  # every sequence carries a policy gradient
    logprobs = buffer.old_logprobs.clone().requires_grad_(True)
    loss, _ = model.micro_batch_loss(buffer, model.micro_batch_terms(buffer, logprobs), model._normalizers[0])
    loss.backward()
    assert (logprobs.grad[observations] == 0).all()
    assert (logprobs.grad[buffer.sampled_mask > 0] != 0).any()
    # The trainer's log-probs of the sampled tokens are the engine's: the transcript is what the engine sampled.
    model_tokens = buffer.sampled_mask > 0
    assert (buffer.old_logprobs - buffer.rollout_logprobs)[model_tokens].abs().max() < 1e-4


def test_the_tool_task_and_its_sft_transcripts_match_what_episodes_produce():
    from lit_rl.data.arithmetic import tool_arithmetic_rows, tool_transcript
    from lit_rl.modeling.models import load_tokenizer
    from lit_rl.rewards.arithmetic import final_answer_correctness

    train, val = tool_arithmetic_rows("train"), tool_arithmetic_rows("val")
    assert len(train) == 20_000 and len(val) == 256
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in val}
    with_tool = sum(row["completion"].startswith("<calc>") for row in train) / len(train)
    assert 0.45 < with_tool < 0.55
    row = val[0]
    expression = row["prompt"][:-1]
    assert calc(expression) == row["answer"]
    # The SFT transcript tokenizes as an episode does: the call turn up to its EOS, the observation encoded on its
    # own, then the answer.
    tokenizer = load_tokenizer("lit-rl/tiny-qwen2-addition-sft")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    observation = ToolEnvironment([calc]).step(f"<calc>{expression}</calc>").observation
    call = encode(f"<calc>{expression}</calc>") + [tokenizer.eos_token_id]
    episode = call + encode(observation) + encode(row["answer"])
    assert encode(tool_transcript(expression, row["answer"])) == episode
    answers = [row["answer"]] * 4
    transcripts = [f"<calc>{expression}</calc><result>{row['answer']}</result>{row['answer']}", row["answer"], "7", ""]
    assert final_answer_correctness(None, transcripts, answers) == [1.0, 1.0, 0.0, 0.0]


def test_a_rank_whose_episodes_ended_joins_the_other_ranks_turns():
    """`any_active` says another rank still runs episodes: this rank's ended one, and it takes part in the two
    remaining turns' collective `generate` with a one-token call on its prompt."""
    engine = ScriptedEngine({1: [[4, EOS], [5], [6]]})
    flags = []

    def others_active(active):
        flags.append(active)
        return len(flags) <= 3

    episodes = run_episodes(
        engine,
        [Echo(1)],
        [[1, 2]],
        SamplingParams(max_new_tokens=8, min_new_tokens=2),
        [10],
        decode=lambda ids: "ok",
        encode_observation=lambda observation, turn: [7],
        reward_names=("r",),
        max_turns=4,
        max_total_tokens=100,
        pad_id=PAD,
        device=torch.device("cpu"),
        runner=EnvironmentRunner(concurrency=4, timeout_s=10.0),
        any_active=others_active,
    )
    assert episodes.output.completion_ids.tolist() == [[4, EOS]] and flags == [True, False, False, False]
    assert [(contexts, seeds, budget) for contexts, seeds, budget in engine.calls] == [
        ([[1, 2]], [10], 8),
        ([[1, 2]], [turn_seed(10, 1)], 1),
        ([[1, 2]], [turn_seed(10, 2)], 1),
    ]


@SCHEDULES
def test_an_environment_that_raises_ends_its_episode_and_is_reported(schedule):
    from tests.integration.envs import Exploding

    engine = ScriptedEngine({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS]]})
    episodes = _run(engine, [Exploding(), Echo(2)], [[1], [2]], schedule=schedule)
    assert episodes.error == "Exploding.step raised RuntimeError: the environment broke"
    assert episodes.output.completion_ids.tolist()[1] == [6, EOS, 7, 7, 8, EOS]  # the other episode ran on

    class Exits(Echo):  # library code that calls sys.exit: it ended the run with exit code 0 and no message
        def step(self, text):
            raise SystemExit(3)

    engine = ScriptedEngine({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS]]})
    episodes = _run(engine, [Exits(2), Echo(2)], [[1], [2]], schedule=schedule)
    assert episodes.error == "Exits.step raised SystemExit: 3"
    assert episodes.output.completion_ids.tolist()[1] == [6, EOS, 7, 7, 8, EOS]


def test_a_cut_off_final_turn_is_truncated_whatever_the_earlier_turns_ended_with():
    from lit_rl.losses.overlong import truncated

    ids = torch.tensor([[4, EOS, 7, 5, 5], [4, EOS, 7, 5, EOS], [4, 5, 0, 0, 0]])
    real = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    sampled = torch.tensor([[1.0, 1, 0, 1, 1], [1, 1, 0, 1, 1], [1, 1, 0, 0, 0]])
    assert truncated(ids, real * sampled, [EOS]).tolist() == [True, False, True]


class Gathering(Echo):
    """Echo of `turns` turns whose steps wait (up to 5 s) until `expected` steps run at once, then sleep `delay_s`
    (so that they return in another order than they started), recording how many ran at once and on which thread."""

    def __init__(self, turns, shared, delay_s=0.0):
        super().__init__(turns)
        self.shared, self.delay_s = shared, delay_s

    def step(self, text):
        shared = self.shared
        with shared["lock"]:
            shared["running"] += 1
            shared["most"] = max(shared["most"], shared["running"])
            shared["threads"].add(threading.current_thread().name)
        deadline = time.monotonic() + 5
        while shared["most"] < shared["expected"] and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(self.delay_s)
        result = super().step(text)
        with shared["lock"]:
            shared["running"] -= 1
        return result


def _gathering(expected):
    return {"lock": threading.Lock(), "running": 0, "most": 0, "threads": set(), "expected": expected}


def _three_episodes():
    return ScriptedEngine({1: [[4, EOS], [3, EOS]], 2: [[6, EOS], [8, 8, EOS]], 5: [[6, 6, EOS], [4, EOS]]})


def test_a_turns_environment_steps_run_together_off_the_training_thread_and_give_the_same_transcripts():
    """Three episodes of 2, 1 and 2 turns whose first steps return last-started first: each outcome still lands on
    its own episode (a mix-up would give episode 2 a second turn or cut episode 1 short), as one at a time does."""

    def episodes(shared, runner):
        envs = [Gathering(2, shared, 0.06), Gathering(1, shared, 0.03), Gathering(2, shared, 0.0)]
        return _run(_three_episodes(), envs, [[1], [2], [5]], seeds=(1, 2, 3), runner=runner)

    concurrent = _gathering(expected=3)
    together = episodes(concurrent, EnvironmentRunner(concurrency=4, timeout_s=10.0))
    assert concurrent["most"] == 3  # all three steps of the first turn at once
    assert threading.current_thread().name not in concurrent["threads"]
    assert together.output.completion_ids.tolist() == [
        [4, EOS, 7, 7, 3, EOS, PAD],
        [6, EOS, PAD, PAD, PAD, PAD, PAD],  # one turn: its step said done
        [6, 6, EOS, 7, 7, 4, EOS],
    ]
    assert together.env_rewards.tolist() == [[2.0], [1.0], [2.0]]

    one_by_one = _gathering(expected=1)
    alone = episodes(one_by_one, EnvironmentRunner(concurrency=1, timeout_s=10.0))
    assert one_by_one["most"] == 1
    for field in ("completion_ids", "completion_mask", "logprobs", "sampled_mask"):
        assert torch.equal(getattr(together.output, field), getattr(alone.output, field)), field
    assert torch.equal(together.env_rewards, alone.env_rewards) and torch.equal(together.stats, alone.stats)


@SCHEDULES
def test_episodes_whose_reset_failed_take_no_turn_and_are_never_stepped(schedule):
    envs = [Echo(2), Echo(2), Echo(2)]
    engine = _three_episodes()
    episodes = _run(engine, envs, [[1], [2], [5]], seeds=(1, 2, 3), ended={1}, schedule=schedule)
    assert envs[1].seen == [] and len(envs[0].seen) == 2
    assert episodes.output.completion_mask[1].sum() == 0 and episodes.stats[1, 0] == 0
    sampled = [context[0] for contexts, _, _ in engine.calls for context in contexts]
    assert sorted(sampled) == [1, 1, 5, 5]  # episode 2 (prompt [2]) was never sampled


def test_an_async_step_that_exits_or_blocks_is_an_outcome_never_a_hang():
    """asyncio re-raises SystemExit out of its loop (its thread would die, the trainer wait forever); an `async`
    method that blocks holds the loop where no time limit reaches it: both come back as outcomes."""

    class Exits(Echo):
        async def step(self, text):
            raise SystemExit(3)

    class Blocks(Echo):
        async def step(self, text):
            time.sleep(2.0)  # blocking the event loop instead of awaiting

    runner = EnvironmentRunner(concurrency=4, timeout_s=0.1)
    (exited,) = runner.run([(Exits(1).step, ("x",))])
    assert isinstance(exited, SystemExit) and exited.code == 3
    runner.loop_margin_s = 0.4  # the loop answers nothing for 2 s: given up after 0.1 + 0.4 s
    (blocked,) = runner.run([(Blocks(1).step, ("x",))])
    assert isinstance(blocked, EnvCallTimeout)  # (waiting for the step would have given its value, None)
    runner.loop_margin_s = 5.0
    assert runner.run([(Exits(1).step, ("y",))])[0].code == 3  # a new loop serves the next batch
    runner.close()


def test_async_environment_steps_are_awaited():
    class AsyncEcho(Echo):
        async def step(self, text):
            await asyncio.sleep(0.01)
            return super().step(text)

    episodes = _run(_three_episodes(), [AsyncEcho(2) for _ in range(3)], [[1], [2], [5]], seeds=(1, 2, 3))
    assert episodes.output.completion_ids.tolist()[0] == [4, EOS, 7, 7, 3, EOS, PAD]
    assert episodes.env_rewards.tolist() == [[2.0], [2.0], [2.0]] and episodes.error is None


@SCHEDULES
def test_a_step_past_its_time_limit_ends_its_episode_and_is_counted_without_waiting_for_it(schedule):
    release = threading.Event()

    class Stuck(Echo):
        def step(self, text):
            release.wait(30)
            return super().step(text)

    start = time.monotonic()
    try:
        episodes = _run(
            _three_episodes(),
            [Echo(2), Stuck(2), Echo(2)],
            [[1], [2], [5]],
            seeds=(1, 2, 3),
            runner=EnvironmentRunner(concurrency=4, timeout_s=2.0),  # the others' steps, even on a busy machine
            schedule=schedule,
        )
    finally:
        release.set()
    assert time.monotonic() - start < 20  # answered at its limit, not when the step returned (30 s)
    ids = episodes.output.completion_ids.tolist()
    assert ids[1][:2] == [6, EOS] and set(ids[1][2:]) <= {PAD}  # ended after its first turn
    assert ids[0] == [4, EOS, 7, 7, 3, EOS, PAD] and episodes.error is None  # the others ran on
    timeouts = episodes.stats[:, EPISODE_STATS.index("env_timeouts")].tolist()
    assert timeouts == [0.0, 1.0, 0.0] and episodes.env_rewards[1].tolist() == [0.0]


def test_environment_concurrency_and_time_limit_are_checked_with_one_line_errors():
    from lit_rl.config import EnvArgs

    with pytest.raises(ConfigError, match=r"model.env.concurrency must be >= 1, got 0"):
        EnvArgs(tools=["lit_rl.envs.tools.calc"], concurrency=0).check()
    for bad in (0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"model.env.step_timeout_s must be > 0 and < 1e6 s, got"):
            EnvArgs(tools=["lit_rl.envs.tools.calc"], step_timeout_s=bad).check()


def test_the_concurrency_bound_holds_across_batches_run_at_once_from_two_threads():
    """Asynchronous episodes reset the next generation's environments on the training thread while the worker steps
    this one's: `model.env.concurrency` bounds the runner's calls together, plain calls and coroutines alike."""
    runner = EnvironmentRunner(concurrency=2, timeout_s=10)
    lock, running, most = threading.Lock(), [0], [0]

    def enter():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])

    def leave():
        with lock:
            running[0] -= 1

    def plain():
        enter()
        time.sleep(0.05)
        leave()

    async def awaited():
        enter()
        await asyncio.sleep(0.05)
        leave()

    try:
        for call in (plain, awaited):
            most[0] = 0
            batches = [threading.Thread(target=runner.run, args=([(call, ())] * 4,)) for _ in range(2)]
            for batch in batches:
                batch.start()
            for batch in batches:
                batch.join(timeout=30)
            assert running[0] == 0 and most[0] == 2, (call.__name__, most[0])
    finally:
        runner.close()


class SeededEngine:
    """Each row's turn is a function of its context and seed alone (1 to 3 tokens, then EOS), as a vLLM request
    with its seed is: batching rows differently cannot change what they sample. Records each call's contexts."""

    needs_weights = False

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def generate(self, prompt_ids, prompt_mask, params, seeds=None):
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        self.calls.append(contexts)
        rows = []
        for context, seed in zip(contexts, seeds):
            draw = torch.Generator().manual_seed(hash((tuple(context), seed)) % 2**31)
            length = int(torch.randint(1, 4, (1,), generator=draw))
            rows.append(torch.randint(10, 20, (length,), generator=draw).tolist() + [EOS])
        width = max(len(r) for r in rows)
        ids, mask = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return RolloutOutput(ids, mask, -0.1 * torch.arange(1, width + 1) * mask)


class Jittery(Echo):
    """Echo whose steps take a random 0-20 ms (episodes' steps end in another order each run), done after `turns`
    turns."""

    def step(self, text):
        time.sleep(0.02 * torch.rand(()).item())
        return super().step(text)


@pytest.mark.parametrize("schedule", ["ready", "independent"])
def test_episodes_on_their_own_or_in_ready_batches_sample_what_lock_step_episodes_sample(schedule):
    """Twelve episodes of 1 to 5 turns against steps that end in random order: each episode's transcript, reward
    parts and counts are the same whether its turns go out with the others', in batches of those that are ready, or
    on their own."""
    runs = {}
    for each in ("lock-step", schedule):
        envs = [Jittery(1 + i % 5) for i in range(12)]
        runs[each] = _run(
            SeededEngine(), envs, [[1 + i % 3] for i in range(12)], max_turns=6, seeds=range(12), schedule=each
        )
    lock_step, other = runs["lock-step"], runs[schedule]
    for field in ("completion_ids", "completion_mask", "logprobs", "sampled_mask"):
        assert torch.equal(getattr(lock_step.output, field), getattr(other.output, field)), field
    assert torch.equal(lock_step.env_rewards, other.env_rewards)
    assert torch.equal(lock_step.stats, other.stats)
    assert lock_step.stats[:, 0].tolist() == [1 + i % 5 for i in range(12)]  # every episode ran its turns


class Slow(Echo):
    """Echo whose first step takes `first_s` seconds."""

    def __init__(self, turns, first_s=0.5):
        super().__init__(turns)
        self.first_s = first_s

    def step(self, text):
        time.sleep(self.first_s if len(self.seen) == 0 else 0.0)
        return super().step(text)


def test_an_independent_episode_takes_its_next_turn_without_waiting_for_a_slow_one():
    """Episode A's first step takes 0.5 s; episode B's three turns are answered at once. On its own, B samples its
    second and third turns while A's step is still running; turn by turn, B's second turn waits for A's step."""
    for schedule in ("lock-step", "independent"):
        engine = ScriptedEngine({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS], [3, EOS]]})
        episodes = _run(engine, [Slow(2), Echo(3)], [[1], [2]], seeds=(1, 2), schedule=schedule)
        order = [[context[0] for context in contexts] for contexts, _, _ in engine.calls]
        if schedule == "independent":
            assert order == [[1, 2], [2], [2], [1]]  # B's turns 2 and 3 before A's turn 2
        else:
            assert order == [[1, 2], [1, 2], [2]]
        assert episodes.stats[:, 0].tolist() == [2, 3]


def test_ready_batches_sample_the_episodes_that_are_back_together_and_wait_one_call_at_most_for_a_slow_one():
    """Calls take 0.25 s; episode A's first step takes 2 s, B's and C's steps answer at once. B and C go on together
    (one call for both, not one each) while A's step runs, each call made once they have waited one call's time;
    A's second turn follows when its step is back. Turn by turn, B's and C's second turns would wait 2 s for A."""
    starts: list[float] = []

    class Timed(ScriptedEngine):
        def generate(self, prompt_ids, prompt_mask, params, seeds=None):
            starts.append(time.monotonic())
            time.sleep(0.25)
            return super().generate(prompt_ids, prompt_mask, params, seeds)

    engine = Timed({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS], [3, EOS]], 3: [[6, EOS], [8, EOS], [3, EOS]]})
    episodes = _run(engine, [Slow(2, 2.0), Echo(3), Echo(3)], [[1], [2], [3]], seeds=(1, 2, 3), schedule="ready")
    order = [[context[0] for context in contexts] for contexts, _, _ in engine.calls]
    assert order == [[1, 2, 3], [2, 3], [2, 3], [1]]
    assert episodes.stats[:, 0].tolist() == [2, 3, 3]
    # B's and C's second and third turns began while A's step ran (it ends 2.25 s after the first call began).
    assert starts[2] - starts[0] < 1.5 and starts[3] - starts[0] >= 2.25


def test_an_engine_failure_in_an_independent_episode_stops_the_episodes_with_it():
    class Failing(ScriptedEngine):
        def generate(self, prompt_ids, prompt_mask, params, seeds=None):
            episodes = [int(ids[mask.bool()][0]) for ids, mask in zip(prompt_ids, prompt_mask)]
            if episodes == [2]:  # episode 2's second turn, on its own (its first went out with episode 1's)
                raise RuntimeError("vLLM server http://127.0.0.1:8000: connection refused")
            return super().generate(prompt_ids, prompt_mask, params, seeds)

    engine = Failing({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS]]})
    with pytest.raises(RuntimeError, match="connection refused"):
        _run(engine, [Echo(2), Echo(2)], [[1], [2]], schedule="independent")


def test_async_steps_queued_behind_other_episodes_calls_are_not_answered_as_timed_out():
    """Independent episodes run one call each, at once, against the shared bound: eight `async` steps of 0.3 s at
    concurrency 2 end after 1.2 s, past one call's limit (0.5 s) and margin; each waits for its slot, and none is
    taken for a blocked event loop."""

    class Awaiting:
        async def step(self, text):
            await asyncio.sleep(0.3)
            return text

    runner = EnvironmentRunner(concurrency=2, timeout_s=0.5)
    runner.loop_margin_s = 0.1
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as threads:
        outcomes = list(threads.map(lambda i: runner.run([(Awaiting().step, (f"turn {i}",))])[0], range(8)))
    runner.close()
    assert outcomes == [f"turn {i}" for i in range(8)]


def test_an_async_step_that_ignores_its_cancellation_is_answered_at_its_limit_and_left_running():
    """asyncio's `wait_for` waits for a cancelled call to finish: one that catches the cancellation and goes on
    (or awaits forever in a `finally`) would hold its slot and its batch for good. It is answered at its limit and
    left running, as an overrunning plain call is."""

    class Stubborn:
        async def step(self, text):
            try:
                await asyncio.sleep(20)
            except asyncio.CancelledError:
                await asyncio.sleep(20)  # ignores its cancellation

    runner = EnvironmentRunner(concurrency=1, timeout_s=0.5)
    start = time.monotonic()
    first, second = runner.run([(Stubborn().step, ("a",)), (Stubborn().step, ("b",))])
    assert time.monotonic() - start < 5  # one at a time: 0.5 s each, not 20
    assert isinstance(first, EnvCallTimeout) and isinstance(second, EnvCallTimeout)
    runner.close()


class Closing(Echo):
    """Echo with an `async close()` (as `lit_rl.envs.OpenEnv` releases its server session) that records it."""

    closed: list[int] = []

    def __init__(self, turns, name):
        super().__init__(turns)
        self.name = name

    async def close(self):
        Closing.closed.append(self.name)


@SCHEDULES
def test_every_environment_is_closed_once_when_its_episodes_end_or_fail(schedule):
    """Episodes that ended or failed release their environments, and so do the episodes of a batch that an engine
    failure stopped; one whose reset failed is left alone (a plain reset past its time limit may still run)."""
    from tests.integration.envs import Exploding

    class ClosingExploding(Exploding):
        async def close(self):
            Closing.closed.append("exploding")

    Closing.closed = []
    engine = ScriptedEngine({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS]], 3: [[5, EOS]]})
    envs = [ClosingExploding(), Closing(2, "two turns"), Closing(2, "reset failed")]
    episodes = _run(engine, envs, [[1], [2], [3]], seeds=(1, 2, 3), ended={2}, schedule=schedule)
    assert episodes.error and sorted(Closing.closed) == ["exploding", "two turns"]

    class Failing(ScriptedEngine):
        def generate(self, prompt_ids, prompt_mask, params, seeds=None):
            raise RuntimeError("vLLM server http://127.0.0.1:8000: connection refused")

    Closing.closed = []
    with pytest.raises(RuntimeError, match="connection refused"):
        _run(Failing({}), [Closing(2, "a"), Closing(2, "b")], [[1], [2]], schedule=schedule)
    assert sorted(Closing.closed) == ["a", "b"]


@pytest.mark.parametrize("schedule", ["ready", "independent"])
def test_an_engine_failure_leaves_open_the_environments_whose_step_is_still_running(schedule):
    """Episode 2's second turn fails in the engine while episode 1's first step (1 s) is still running: the run
    stops at once, episode 2's environment is closed, and episode 1's is not closed under its running step."""

    class SlowClosing(Closing):
        def step(self, text):
            time.sleep(1.0 if self.name == "slow" else 0.0)
            return super().step(text)

    class FailsAlone(ScriptedEngine):
        def generate(self, prompt_ids, prompt_mask, params, seeds=None):
            if len(prompt_ids) == 1:  # a turn on its own: episode 2's second, while episode 1's step runs
                raise RuntimeError("vLLM server http://127.0.0.1:8000: connection refused")
            return super().generate(prompt_ids, prompt_mask, params, seeds)

    Closing.closed = []
    engine = FailsAlone({1: [[4, EOS], [5, EOS]], 2: [[6, EOS], [8, EOS]]})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="connection refused"):
        _run(engine, [SlowClosing(2, "slow"), SlowClosing(2, "fast")], [[1], [2]], schedule=schedule)
    assert Closing.closed == ["fast"] and time.monotonic() - start < 0.9


class TokenEcho(TokenEnvironment):
    """A `TokenEnvironment`: records each turn it gets, answers observation ids [7, 7] once, then ends."""

    def __init__(self) -> None:
        super().__init__(tokenizer="unused")
        self.turns: list[SampledTurn] = []

    def step(self, turn):
        self.turns.append(turn)
        done = len(self.turns) >= 2
        return StepResult(None if done else TokenIds([7, 7]), {}, done)


def test_a_token_environment_gets_the_sampled_ids_and_whether_a_stop_id_ended_the_turn():
    """Its turn 1 ends on 11, a stop id the tokenizer does not name (a generation-config EOS); its turn 2 is cut at
    its budget of 3 tokens. The transcript is the ids as sampled and as the environment gave them."""
    engine = ScriptedEngine({1: [[4, 11], [5, 5, 5, 5]]})
    env = TokenEcho()
    episodes = run_episodes(
        engine,
        [env],
        [[1]],
        SamplingParams(max_new_tokens=3),
        [5],
        decode=lambda ids: "unused",
        encode_observation=lambda observation, turn: list(observation),
        reward_names=(),
        max_turns=4,
        max_total_tokens=100,
        pad_id=PAD,
        device=torch.device("cpu"),
        runner=EnvironmentRunner(concurrency=1, timeout_s=10.0),
        stop_ids=frozenset({EOS, 11}),
    )
    assert env.turns == [SampledTurn([4, 11], [-0.5, -0.5], True), SampledTurn([5, 5, 5], [-0.5] * 3, False)]
    assert episodes.output.completion_ids.tolist() == [[4, 11, 7, 7, 5, 5, 5]]
    assert episodes.output.sampled_mask.tolist() == [[1, 1, 0, 0, 1, 1, 1]]


def test_a_token_environment_without_close_whose_prompt_is_too_long_gets_the_length_error():
    """A `TokenEnvironment` need not define `close`: the length check closed the environment without asking, so its
    run stopped on `AttributeError: ... no attribute 'close'` instead of naming the length and the key to raise."""
    from lit_rl.errors import EnvironmentStepError
    from tests.conftest import fit_grpo

    with pytest.raises(EnvironmentStepError) as failed:
        fit_grpo(environment="tests.integration.envs.LongTokenPrompt", max_turns=1, max_prompt_length=16)
    assert str(failed.value) == (
        "LongTokenPrompt.reset gave a prompt of 40 tokens, more than model.sampling.max_prompt_length "
        "(16): raise it (its world rendered it whole)"
    )


def test_an_environments_malformed_return_is_said_as_returned_not_raised():
    """What `step` returned that lit-rl cannot read is the return's fault, said as such: `Boom.step raised
    TypeError: ...` read as if the environment itself had raised."""
    from lit_rl.envs.base import as_step_result
    from lit_rl.errors import EnvironmentStepError
    from lit_rl.rollout.multi_turn import _add_reward_parts

    with pytest.raises(EnvironmentStepError, match=r"^Boom.step returned 'oops', not a StepResult"):
        as_step_result("oops", "Boom")
    with pytest.raises(EnvironmentStepError, match=r"^Boom.step returned rewards 3, not a dict of reward parts"):
        as_step_result(("obs", 3, True), "Boom")
    with pytest.raises(EnvironmentStepError, match=r"^Boom.step returned reward part 'r' = 'abc', not a number"):
        _add_reward_parts(torch.zeros(1), {"r": "abc"}, {"r": 0}, "Boom.step")
