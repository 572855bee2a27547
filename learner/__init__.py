"""Learner: the training loop (trainer.py) over the hub, policy step, weight sync, control plane, checkpoints."""
