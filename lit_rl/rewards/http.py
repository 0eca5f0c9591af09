"""A reward served over HTTP: `rewards: {funcs: [http://127.0.0.1:8000/score]}`.

Each call POSTs JSON batches of at most `batch_size` completions,

    {"prompts": [...], "completions": [...], "columns": {"answer": [...], "completion_ids": [...], ...},
     "trainer_state": {"global_step": 12, "max_steps": 1000, "epoch": 0.0}}

(completions as text, or as one assistant message each for chat prompts: `lit_rl.rewards`)

and expects `{"rewards": [one number or null per completion]}` back. Batches are sent concurrently (up to
`max_concurrency`), each with a time limit and up to `max_retries` retries (on a connection error, a timeout or a 5xx
status, waiting 0.5 s, 1 s, ... between tries). When a batch still fails, the run stops with one line naming the URL
(`RewardFunctionError`). The time limit is for the whole answer, which may be at most 64 MiB; an answer cut short
is retried. Only the URLs a config names are contacted: no proxy from the environment, no redirects
(`lit_rl.net`); nothing binds a port.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Sequence

from lit_rl.errors import RewardFunctionError
from lit_rl.net import AnswerTooLarge, open_within, read_answer

MAX_ANSWER_BYTES = 64 << 20  # a number per completion: kilobytes; a server answering more is refused


def is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def url_address(url: str) -> str:
    """`url`'s host and port as a name's part (`127.0.0.1:8001` -> `127_0_0_1_8001`)."""
    parsed = urllib.parse.urlparse(url)
    return re.sub(r"\W", "_", f"{parsed.hostname}_{parsed.port}" if parsed.port else str(parsed.hostname))


def url_reward_name(url: str) -> str:
    """A metric name for the reward at `url`: its last path segment (`/score` -> `score`), else `http_<port>`."""
    parsed = urllib.parse.urlparse(url)
    segment = parsed.path.rstrip("/").rsplit("/", 1)[-1]
    return segment or f"http_{parsed.port or parsed.hostname}"


# Columns that are objects of this process, not data: a TRL environment's instances (`environments=`), TRL's
# logging hooks.
LOCAL_COLUMNS = ("environments", "log_extra", "log_metric")


class HTTPReward:
    """A reward function `(prompts, completions, **columns) -> list[float]` that asks the server at `url`."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        batch_size: int = 64,
        max_concurrency: int = 8,
    ) -> None:
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self.__name__ = url_reward_name(url)

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], trainer_state: Any = None, **columns: Any
    ) -> list[Any]:
        starts = range(0, len(completions), self.batch_size)
        state = dataclasses.asdict(trainer_state) if dataclasses.is_dataclass(trainer_state) else None
        batches = [
            {
                "prompts": list(prompts[s : s + self.batch_size]),
                "completions": list(completions[s : s + self.batch_size]),
                "columns": {
                    key: list(values[s : s + self.batch_size])
                    for key, values in columns.items()
                    if values is not None and key not in LOCAL_COLUMNS
                },
                "trainer_state": state,
            }
            for s in starts
        ]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            results = list(pool.map(self._post, batches))
        return [value for batch in results for value in batch]

    def _post(self, batch: dict[str, Any]) -> list[Any]:
        body = json.dumps(batch).encode()
        problem, attempts = "", 0
        for attempt in range(self.max_retries + 1):
            attempts += 1
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            deadline = time.monotonic() + self.timeout_s  # for the whole answer, however slowly it comes
            try:
                with open_within(request, self.timeout_s, deadline) as response:
                    answer = json.loads(read_answer(response, MAX_ANSWER_BYTES, deadline))
            except AnswerTooLarge as err:
                problem = f"answered too much ({err})"
                break
            except http.client.IncompleteRead:
                problem = "answered less than it announced (the connection closed)"
                continue
            except urllib.error.HTTPError as err:
                problem = f"HTTP {err.code}"
                if err.code < 500:
                    break  # the server refused the request itself: retrying would not change that
                continue
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                problem = "timed out" if "timed out" in str(reason) else f"unreachable ({reason})"
                continue
            except json.JSONDecodeError:
                problem = "answered something that is not JSON"
                break
            rewards = answer.get("rewards") if isinstance(answer, dict) else None
            if not isinstance(rewards, list) or len(rewards) != len(batch["completions"]):
                raise RewardFunctionError(
                    f"reward server {self.url} must answer {{'rewards': [...]}} with {len(batch['completions'])} "
                    f"values, got {str(answer)[:200]}"
                )
            return rewards
        tries = f"{attempts} tries" if attempts > 1 else "1 try"
        raise RewardFunctionError(f"reward server {self.url}: {problem} after {tries} (timeout {self.timeout_s:g} s)")
