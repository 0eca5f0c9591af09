"""Algorithms whose reference is an explicitly loaded frozen copy even with LoRA: what LoRA's adapter-off reference
replaces, for the tests that prove both give the same numbers (`--model.class_path` of the CLI selects them)."""

from lit_rl.algorithms import DPO, GRPO


class _FrozenCopyReference:
    def configure_model(self) -> None:
        if self.ref_model is None:
            self.ref_model = self.load_reference()
        super().configure_model()


class GRPOWithFrozenCopy(_FrozenCopyReference, GRPO):
    pass


class DPOWithFrozenCopy(_FrozenCopyReference, DPO):
    pass
