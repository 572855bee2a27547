"""Learner: the training loop (trainer.py) over the hub, policy step, publisher, control plane, checkpoints."""
