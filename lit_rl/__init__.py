"""lit-rl: reinforcement-learning fine-tuning of language models, with Lightning owning the loop."""

__version__ = "0.2.0"
