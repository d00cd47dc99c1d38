"""Pipeline stages and micro-batching in one schedule (`pipeline_value_and_grad`).

`schedules.py` makes each schedule's lockstep table (pure numpy), `executor.py` runs
it on each device under `jax.shard_map`, and `pipeline.py` is the public door: its
options, the split into micro-batches, the routes (the user's `shard_map`, or global
view), and the one normalisation and reduction after the loop.
"""
