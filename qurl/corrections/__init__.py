"""Corrections for a quantized, stale sampler as named pieces: importance weights, rejection masks, clipping rules
and objectives, each in one registry (registry.py), combined by presets (presets.py); docs/algorithms.md."""
