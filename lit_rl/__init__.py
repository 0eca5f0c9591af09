"""lit-rl: reinforcement-learning fine-tuning of language models, with Lightning owning the loop."""

from lit_rl.numerics import settle_cpu_math_kernels

__version__ = "0.1.0"

# Before anything in this process runs threaded float math: MKL's first-call race (lit_rl/numerics.py).
settle_cpu_math_kernels()
