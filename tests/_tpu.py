"""Compiling for TPU topologies without a TPU: the scaffolding of the `tpu` tier.

`jax[tpu]` brings libtpu, the TPU compiler, which compiles for a named topology ("v5e:2x2",
"v5e:4x4", ...) on a machine without a TPU (SPEC.md section 17): the programs' inputs are
`jax.ShapeDtypeStruct`s sharded over the topology's devices, and nothing runs. The tests
that do this are marked `tpu` and skip, with `REASON`, where libtpu is absent (the project's
`.venv`); `bash dev.sh test-tpu` builds `.venv-tpu` and runs them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

# Each test module of the tier starts with `pytest.importorskip("libtpu", reason=REASON)`.
REASON = "needs libtpu (jax[tpu]) to compile for TPU topologies: bash dev.sh test-tpu"


def mesh(topology: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh of `shape` over the first devices of a TPU `topology`, with Explicit axes."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    count = int(np.prod(shape))
    if count > len(devices):
        raise ValueError(f"{topology=} has {len(devices)} chips; a mesh of {shape=} needs {count}")
    return jax.sharding.Mesh(
        np.array(devices[:count]).reshape(shape),
        axes,
        axis_types=(jax.sharding.AxisType.Explicit,) * len(axes),
    )


def abstract(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """`tree`'s leaves (arrays or shape-dtype structs) as `jax.ShapeDtypeStruct`s placed by
    `sharding`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def nbytes(tree: Any) -> int:
    """Bytes of a tree's leaves (of their global shapes)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
