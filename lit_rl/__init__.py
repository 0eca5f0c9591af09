"""lit-rl: reinforcement-learning fine-tuning of language models, with Lightning owning the loop."""

__version__ = "0.1.0"
