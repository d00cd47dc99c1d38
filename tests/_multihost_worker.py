"""One process of test_distributed's multi-process run (not a test module).

    python tests/_multihost_worker.py PORT PROCESS_ID DIR

Reads DIR/data.npz, joins a 2-process jax.distributed job on 127.0.0.1:PORT
with gloo CPU collectives, trains on a global 4-device mesh (2 devices per
process, forced by the caller's XLA_FLAGS) and writes DIR/result_<id>.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(port: str, process_id: int, out_dir: Path) -> None:
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
    )
    import numpy as np
    import optax
    from _dp_common import D_IN, D_OUT, B, shard_map_fns
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import gradaccum_jax as ga

    data = np.load(out_dir / "data.npz")
    xs, ys = data["xs"], data["ys"]
    params = {name[2:]: data[name] for name in data.files if name.startswith("p_")}
    windows, k, replicas = xs.shape[:3]
    assert jax.device_count() == replicas and jax.local_device_count() == 2

    mesh = jax.make_mesh((replicas,), ("data",))
    tx = ga.accumulate(optax.adam(1e-2), k, axis_name="data")
    init, step = shard_map_fns(tx, params, mesh, "data")
    batch = NamedSharding(mesh, P("data"))

    def global_batch(a):
        return jax.make_array_from_callback(a.shape, batch, lambda index: a[index])

    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params)
    for w in range(windows):
        for i in range(k):
            x = global_batch(xs[w, i].reshape(replicas * B, D_IN))
            y = global_batch(ys[w, i].reshape(replicas * B, D_OUT))
            params, state = step(params, state, x, y)

    skipped = multihost_utils.process_allgather(state.num_skipped, tiled=True)
    np.savez(
        out_dir / f"result_{process_id}.npz",
        gradient_step=np.asarray(state.gradient_step),
        num_skipped_total=skipped.sum(),
        **{f"p_{name}": np.asarray(leaf.addressable_data(0)) for name, leaf in params.items()},
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
