"""benchmarks/roofline.py: the flops and bytes it reads from a compiled program; its estimate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from benchmarks import harness, roofline

pytestmark = pytest.mark.hlo  # reads compiled programs (XLA's defaults: conftest.py)


def _hlo(fn, *args) -> tuple[harness.Hlo, dict]:
    compiled = jax.jit(fn).lower(*args).compile()
    cost = compiled.cost_analysis()
    return harness.Hlo(compiled), cost[0] if isinstance(cost, list) else cost


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_matrix_products_count_two_flops_per_multiply_add_as_xla_does():
    # (64 x 128) @ (128 x 96), then @ (96 x 32): 2 M K N each, XLA's own count alike.
    hlo, cost = _hlo(lambda x, a, b: (x @ a) @ b, _f32(64, 128), _f32(128, 96), _f32(96, 32))
    flops, _ = roofline.costs(hlo)
    assert flops == 2 * 64 * 128 * 96 + 2 * 64 * 96 * 32
    assert flops == pytest.approx(cost["flops"], rel=1e-3)


def test_a_convolution_counts_its_kernel_per_output_element():
    def conv(padding):
        return lambda x, k: jax.lax.conv_general_dilated(
            x, k, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    image, kernel = _f32(2, 16, 16, 8), _f32(3, 3, 8, 4)
    # 14 x 14 outputs, each of 3 x 3 x 8 products per output feature.
    hlo, cost = _hlo(conv("VALID"), image, kernel)
    assert roofline.costs(hlo)[0] == 2 * (2 * 14 * 14 * 4) * (3 * 3 * 8) == cost["flops"]
    # With a padded border XLA leaves out the products with the padding; the estimate
    # counts them (measured: 294,912 against XLA's 270,848 here).
    hlo, cost = _hlo(conv("SAME"), image, kernel)
    flops = roofline.costs(hlo)[0]
    assert flops == 2 * (2 * 16 * 16 * 4) * (3 * 3 * 8) > cost["flops"] > 0.9 * flops


def test_a_loop_counts_its_trips_and_a_conditional_the_branch_asked_for():
    def scanned(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    hlo, _ = _hlo(scanned, _f32(8, 64), _f32(64, 64))
    assert roofline.costs(hlo)[0] == 5 * 2 * 8 * 64 * 64

    def branchy(p, x, w):
        return jax.lax.cond(p, lambda: x @ w, lambda: x)

    hlo, cost = _hlo(branchy, jax.ShapeDtypeStruct((), bool), _f32(8, 64), _f32(64, 64))
    taken, skipped = roofline.costs(hlo, 1), roofline.costs(hlo, 0)
    assert (taken[0], skipped[0]) == (2 * 8 * 64 * 64, 0)
    # Both branches, as XLA's static count (`cost_analysis()`) adds them; XLA counts the
    # predicate's element-wise work too (measured: 1 flop).
    assert roofline.costs(hlo)[0] == taken[0] == pytest.approx(cost["flops"], abs=4)
    assert taken[1] > skipped[1]


def test_bytes_are_each_op_s_operands_read_and_result_written():
    n = 1024
    hlo, _ = _hlo(lambda x, y: x + y, _f32(n), _f32(n))
    assert roofline.costs(hlo)[1] == 3 * 4 * n


def test_the_estimate_is_the_slower_of_compute_and_memory_on_the_chip_s_peaks():
    v5e = roofline.CHIPS["v5e"]
    hlo, _ = _hlo(lambda x, y: x + y, _f32(1 << 20), _f32(1 << 20))
    added = roofline.estimate(hlo, "v5e")
    assert added.bound == "memory"
    assert added.seconds == pytest.approx(3 * 4 * (1 << 20) / v5e.hbm_bytes_per_s)
    hlo, _ = _hlo(jnp.matmul, _f32(4096, 4096), _f32(4096, 4096))
    product = roofline.estimate(hlo, v5e)
    assert product.bound == "compute"
    assert product.seconds == pytest.approx(2 * 4096**3 / v5e.flops_per_s)
    assert product.microseconds == pytest.approx(1e6 * product.seconds)
