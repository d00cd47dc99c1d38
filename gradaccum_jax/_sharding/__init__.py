"""Partial sums over mesh axes (typed unreduced values), checkpointing of sharded state, and
the memory of compiled programs (one device's) that the planners search."""
