"""Differential privacy: per-example clipping, the noisy window, accounting."""
