"""Micro-batching a loss: the planner, micro-batched and per-device (unreduced) `value_and_grad`."""
