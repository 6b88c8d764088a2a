"""The learner: the PPO update, its models and checkpoints (a regular package, so the import contracts see it)."""
