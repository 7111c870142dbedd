"""What the tests of jax_ep.grouped_matmul share (test_grouped_matmul on CPU, gpu/test_grouped_matmul_gpu): the
NumPy float64 oracle of its forward and gradients, the jitted forward + VJP under test, and the relative error
they are held to."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import grouped_matmul


def silu_mul(gate, up):
    """SwiGLU's activation in jnp (float32 in and out): the gate_up_activation the kernels' tests give."""
    return gate * jax.nn.sigmoid(gate) * up


def oracle_group_ranges(group_sizes, num_rows):
    """[start, end) of each group: rows handed out in order, a negative size counting as 0, cut at num_rows."""
    ranges, start = [], 0
    for size in group_sizes:
        end = min(start + max(int(size), 0), num_rows)
        ranges.append((start, end))
        start = end
    return ranges


def oracle(x, w, dy, group_sizes):
    """y, dx, dw of grouped_matmul in float64."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    for g, (start, end) in enumerate(oracle_group_ranges(group_sizes, x.shape[0])):
        y[start:end] = x[start:end] @ w[g]
        dx[start:end] = dy[start:end] @ w[g].T
        dw[g] = x[start:end].T @ dy[start:end]
    return y, dx, dw


@functools.partial(jax.jit, static_argnames=("implementation", "num_sms"))
def forward_and_grads(x, w, dy, group_sizes, implementation="ragged_dot", num_sms=None):
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, group_sizes, implementation=implementation, num_sms=num_sms),
                     x, w)
    return (y, *vjp(dy))


def relative_error(actual, expected):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    return np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
