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
