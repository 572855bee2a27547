"""qurl: asynchronous RL with quantized rollout."""
