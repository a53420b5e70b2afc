"""The benches' roofline pieces: XLA's flop count of a compiled function and the matmul peak."""

import jax.numpy as jnp

from iclab.experiments._roofline import compiled_flops, matmul_peak_gflops


def test_compiled_flops_counts_a_product_as_2mnk():
    a, b = jnp.ones((24, 40), jnp.float32), jnp.ones((40, 56), jnp.float32)
    assert compiled_flops(lambda x, y: x @ y, a, b) == 2 * 24 * 40 * 56


def test_matmul_peak_is_a_positive_rate():
    assert 0.01 < matmul_peak_gflops(128, seconds=0.05) < 1e5  # GFLOP/s: from a slow CPU to a GPU
