"""A reader's environment, written for TRL's `GRPOTrainer(environment_factory=IncrementEnv)`."""


class IncrementEnv:
    def reset(self, **row) -> str:
        self.counter = 0
        return " Increment the counter to 3."

    def get_reward(self) -> float:
        return float(self.counter == 3)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


class DoubleEnv:
    """A second environment, for TRL's dict of environments (`environment_factory={"count": ..., "double": ...}`)."""

    def reset(self, **row) -> str:
        self.value = 1
        return " Double the value twice."

    def get_reward(self) -> float:
        return float(self.value == 4)

    def double(self, times: int) -> int:
        """
        Double the value a number of times.

        Args:
            times: How many times to double it.
        """
        self.value *= 2**times
        return self.value
