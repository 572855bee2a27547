"""The real track: SmolLM2-135M-Instruct (from a registry wheel) on GSM-Symbolic grade-school math, on CPU."""
