"""Runnable examples: `python -m jax_ep.examples.train_moe`."""
