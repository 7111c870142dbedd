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
    outside jit, rather than letting every apply make its own.

    With expert_bias=True the bias lives in the "ExpertBias" collection (not "params": optimizers leave it
    alone). Its balancing step is the module's method, called through the bridge:

        y, aux = block.apply(variables, x)
        _, updated = block.apply(variables, aux.tokens_per_expert, rate, nnx_method="update_expert_bias",
                                 mutable=["ExpertBias"])
        variables = {**variables, **updated}"""
    return nnx.bridge.to_linen(MoE, *args, name=name, **kwargs)


__all__ = ["MoE", "MoEAux", "moe_linen", "from_dense", "ExpertBias", "RouterConfig", "DISPATCHERS"]
