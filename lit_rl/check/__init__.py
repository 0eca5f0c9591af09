"""`lit-rl check`: prove a user's own config trains the same numbers in layouts that must agree (accumulation,
ranks, packing, resume) and checkpoints at exactly the steps asked for. See `lit_rl.check.command`."""
