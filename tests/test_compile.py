"""sclaro_jax.compile: the CPU options take effect and leave the numbers unchanged."""

import jax
import jax.numpy as jnp
import numpy as np

from sclaro_jax import compile as sj_compile


def test_cpu_options_route_matmuls_off_ynnpack():
    assert sj_compile.compiler_options("cpu") == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert sj_compile.compiler_options("gpu") == {}
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 96), np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((96, 80), np.float32))
    fn = lambda x, w: jax.nn.relu(x @ w)  # noqa: E731
    default = jax.jit(fn).lower(x, w).compile()
    ours = sj_compile.jit(fn).lower(x, w).compile()
    assert "__ynn_fusion" in default.as_text()  # what the option exists to change
    assert "__ynn_fusion" not in ours.as_text()
    np.testing.assert_allclose(np.asarray(ours(x, w)), np.asarray(default(x, w)),
                               rtol=1e-5, atol=1e-5)
