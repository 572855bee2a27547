"""Learner: FSDP2 trainer, trajectory buffer, weight sender, checkpoints."""
