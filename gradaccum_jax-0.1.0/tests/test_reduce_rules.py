"""The per-leaf reduce rule: which gradient leaves combine by max (Flax's fp8 metadata)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.linen import fp8_ops

import gradaccum_jax as ga
from gradaccum_jax._base import reduce_rules

META = fp8_ops.OVERWRITE_WITH_GRADIENT


def test_auto_marks_the_collection_and_the_fp8_meta_dtype():
    tree = {
        "params": {"w": jnp.ones(2)},
        META: {"dense": {"input_scale": jnp.ones(1)}},
        "other": jax.lax.convert_element_type(jnp.ones(2), fp8_ops.fm32),
    }
    mask = reduce_rules.max_mask(tree)
    assert mask == {"params": {"w": False}, META: {"dense": {"input_scale": True}}, "other": True}
    assert reduce_rules.max_mask(tree, None)[META]["dense"]["input_scale"] is False
    assert reduce_rules.max_paths(mask) == [f"['{META}']['dense']['input_scale']", "['other']"]


def test_fp8_meta_leaves_are_compared_as_floats():
    x = jax.lax.convert_element_type(jnp.array([1.0, 3.0]), fp8_ops.fm32)
    assert reduce_rules.float_dtype(x.dtype) == jnp.float32
    assert jnp.array_equal(reduce_rules.as_float(x), jnp.array([1.0, 3.0]))
    assert reduce_rules.max_identity(jnp.float32) == -jnp.inf
    assert reduce_rules.max_identity(jnp.int32) == jnp.iinfo(jnp.int32).min


def test_check_max_leaves_names_the_choices():
    assert reduce_rules.check_max_leaves("auto") == "auto"
    with pytest.raises(ValueError, match=r"'auto'.*None.*callable"):
        reduce_rules.check_max_leaves("max")


def test_accumulate_refuses_fp8_metadata_and_names_the_fix():
    variables = {"params": {"w": jnp.ones(2)}, META: {"input_scale": jnp.ones(1)}}
    tx = optax.chain(optax.clip(1.0), ga.accumulate(optax.adam(1e-3), 4))
    with pytest.raises(ValueError, match=r"variables\['params'\].*TrainState"):
        tx.init(variables)
    tx.init(variables["params"])


def test_unreduced_value_and_grad_refuses_fp8_metadata():
    variables = {"params": {"w": jnp.ones(2)}, META: {"input_scale": jnp.ones(1)}}

    def loss(variables, x):
        return jnp.mean(x @ variables["params"]["w"]) * variables[META]["input_scale"][0]

    with pytest.raises(ValueError, match="microbatch_value_and_grad in the global-view jit"):
        ga.unreduced_value_and_grad(loss, "data")(variables, jnp.ones((8, 2)))
