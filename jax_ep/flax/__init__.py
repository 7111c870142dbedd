"""Flax modules on jax_ep: an expert-parallel MoE block (flax.nnx), its Linen wrapper, and the swap-in of a
dense MoE block's weights. Needs flax (`pip install flax`); `import jax_ep` itself does not."""
from flax import nnx

from jax_ep.flax.moe import DISPATCHERS, ExpertBias, MoE, MoEAux
from jax_ep.flax.routing import RouterConfig
from jax_ep.flax.swap_in import from_dense


def moe_linen(*args, name: str | None = None, **kwargs):
    """The block as a Linen module (through flax.nnx.bridge): takes MoE's arguments except rngs (Linen's
    "params" rng stream initialises it); its parameters live in the "params" collection.

    The wrapper builds the nnx module again at every apply, so pass buffer= a jax_ep.Buffer made once,
    outside jit, rather than letting every apply make its own."""
    return nnx.bridge.to_linen(MoE, *args, name=name, **kwargs)


__all__ = ["MoE", "MoEAux", "moe_linen", "from_dense", "ExpertBias", "RouterConfig", "DISPATCHERS"]
