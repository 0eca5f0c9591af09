"""Log messages a user cannot act on, and the filter that keeps them out of a console (imports only `logging`, so
that a vLLM server's processes can load it from lit-rl's plugin).

`WEIGHT_PUSH_MESSAGES` are what vLLM logs at every weight push: its own timing of the reload (lit-rl logs
`perf/weight_push_s`), the prefix-cache reset that must follow new weights, and `RotaryEmbedding: Failed to load
weights` (the rotary cos/sin cache is computed from the config and in no checkpoint, so it keeps its values:
tests/integration/test_vllm.py compares every engine parameter with the policy's after a push, equal, none left out).
The trainer drops them from a colocated engine (`lit_rl.cli.IGNORED_LOG_MESSAGES`), and a server lit-rl starts
drops them from its log (`QUIET_SERVER_ENV`, read by `lit_rl.rollout.in_server.vllm_transfer_plugin.register`).
"""

from __future__ import annotations

import logging

WEIGHT_PUSH_MESSAGES = {  # logger name -> message prefixes
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    "vllm.model_executor.model_loader.reload.inplace": ("Reloading weights inplace", "Reloading and processing"),
    "vllm.v1.core.block_pool": ("Successfully reset prefix cache",),
}
# Set in the environment of the vLLM servers lit-rl starts (`lit_rl.rollout.server.client.server_command`): their
# processes then drop `WEIGHT_PUSH_MESSAGES` too. A server you start yourself logs them (docs/rollouts.md says why).
QUIET_SERVER_ENV = "LIT_RL_QUIET_WEIGHT_PUSHES"


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def drop_log_messages(messages: dict[str, tuple[str, ...]]) -> None:
    """Drop `messages` ({logger name: message prefixes}) from those loggers; idempotent."""
    for name, prefixes in messages.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) and f.prefixes == prefixes for f in logger.filters):
            logger.addFilter(DropMessages(prefixes))
