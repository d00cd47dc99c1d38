"""Differential privacy with accumulation: per-example clipping, the noisy window, accounting."""
