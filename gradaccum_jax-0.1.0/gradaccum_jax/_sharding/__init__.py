"""Partial sums over mesh axes (typed unreduced values) and checkpointing of sharded state."""
