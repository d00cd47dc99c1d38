"""One process of test_global_view's two-process run (not a test module).

    python tests/_global_view_worker.py PORT PROCESS_ID DIR

Reads DIR/data.npz, joins a 2-process jax.distributed job on 127.0.0.1:PORT
with gloo CPU collectives, trains a global-view jitted step on an explicit
4-device mesh (2 devices per process, forced by the caller's XLA_FLAGS) with
unreduced gradients and a ZeRO-1 accumulate, and writes DIR/result_<id>.npz.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def loss_fn(params, x, y):
    import jax.numpy as jnp

    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def main(port: str, process_id: int, out_dir: Path) -> None:
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
    )
    import numpy as np
    import optax

    import gradaccum_jax as ga
    from gradaccum_jax._base.compat import reshard

    data = np.load(out_dir / "data.npz")
    xs, ys = data["xs"], data["ys"]
    params = {name[2:]: data[name] for name in data.files if name.startswith("p_")}
    windows, k, replicas = xs.shape[:3]
    assert jax.device_count() == replicas and jax.local_device_count() == 2

    mesh = jax.make_mesh((replicas,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = ga.accumulate(optax.adam(1e-2), k, shard_inner_state="data")
    grad_fn = ga.unreduced_value_and_grad(loss_fn, "data", batch_argnums=(1, 2))

    @jax.jit
    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        batch = jax.NamedSharding(mesh, jax.P("data"))

        def global_batch(a):
            return jax.make_array_from_callback(a.shape, batch, lambda index: a[index])

        params = jax.device_put(params, jax.P())
        state = jax.jit(tx.init)(params)
        for w in range(windows):
            for i in range(k):
                x = global_batch(xs[w, i].reshape(-1, xs.shape[-1]))
                y = global_batch(ys[w, i].reshape(-1, ys.shape[-1]))
                params, state = step(params, state, x, y)
        skipped = jax.jit(lambda n: reshard(n, jax.P()))(state.num_skipped)
    np.savez(
        out_dir / f"result_{process_id}.npz",
        gradient_step=np.asarray(state.gradient_step.addressable_data(0)),
        num_skipped_total=np.asarray(skipped.addressable_data(0)),
        **{f"p_{name}": np.asarray(leaf.addressable_data(0)) for name, leaf in params.items()},
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
