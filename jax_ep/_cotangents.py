"""How the custom_vjp rules type their cotangents inside shard_map: zeros for integer inputs, and each cotangent
varying over exactly the mesh axes its primal varies over."""
from __future__ import annotations

import jax
import numpy as np


def zero_cotangent(tree):
    """The cotangent of non-differentiable (integer / bool) inputs, for custom_vjp rules."""
    return jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), tree)


def varying_axes(value) -> frozenset:
    """The shard_map axes `value` varies over (jax >= 0.10: manual_axis_type.varying; older: vma)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def typed_like(value, *like):
    """`value` varying over exactly the shard_map axes that `like` vary over. A pallas_call's result varies
    over none, and a custom_vjp must return each cotangent typed like its primal: axes missing are added
    (pcast), and a cotangent varying over an axis its primal does not is summed over it (what JAX's
    transpose of the implicit pcast does)."""
    wanted = frozenset().union(*(varying_axes(v) for v in like))
    have = varying_axes(value)
    if have - wanted:
        value = jax.lax.psum(value, tuple(sorted(have - wanted)))
    if wanted - have:
        value = jax.lax.pcast(value, tuple(sorted(wanted - have)), to="varying")
    return value


def types_of(tree):
    """Zero-row slices of the arrays of `tree`: all a backward pass needs of a primal to type its cotangent (the
    shard_map axes it varies over), without keeping the array alive until then."""
    return jax.tree.map(lambda a: a[:0], tree)
