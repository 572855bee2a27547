"""Rollout server: engines, generation loop, admission control, weight receiver."""
