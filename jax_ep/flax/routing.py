"""The MoE router: token -> top-k experts and gate weights, and the router's auxiliary losses.

One implementation serves every dispatcher: it runs on the tokens where they are (per rank inside a
shard_map, or globally for the dense reference); only the loss statistics are reduced over the EP axis.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    num_experts_per_tok: int
    # "softmax": probabilities over the experts (Mixtral, Qwen-MoE); "sigmoid": independent affinities (DeepSeek-V3)
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    # Grouped (device-limited) top-k: keep the `topk_groups` best of `n_groups` expert groups, then top-k inside them.
    n_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = True  # renormalise the k gate weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the gate weights (after normalisation)

    def __post_init__(self):
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {self.score_function!r}")
        if self.num_experts % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}]")
        selectable = self.topk_groups * (self.num_experts // self.n_groups)
        if not 1 <= self.num_experts_per_tok <= selectable:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {selectable}] "
                             f"(the experts of topk_groups={self.topk_groups} groups)")


class Routing(NamedTuple):
    topk_idx: jax.Array  # int32 [T, K]: global expert ids
    topk_weights: jax.Array  # float32 [T, K]: gate weights
    scores: jax.Array  # float32 [T, E]: softmax probabilities or sigmoid affinities (without the bias)
    logits: jax.Array  # float32 [T, E]


def route(x, kernel, expert_bias, config: RouterConfig) -> Routing:
    """x [T, D], kernel [D, E]; expert_bias [E] or None is added to the scores for the selection only
    (DeepSeek-V3's auxiliary-loss-free balancing), never to the gate weights."""
    logits = x.astype(jnp.float32) @ kernel.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if config.score_function == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
    if config.n_groups > 1:
        choice = _keep_best_groups(choice, config)
    _, topk_idx = jax.lax.top_k(choice, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(topk_idx.astype(jnp.int32), weights * config.routed_scaling_factor, scores, logits)


def _keep_best_groups(choice, config: RouterConfig):
    """Scores of experts outside the `topk_groups` best groups become -inf. A group's score is its best
    expert's (DeepSeek-V2, softmax) or the sum of its best two (DeepSeek-V3, sigmoid)."""
    num_tokens = choice.shape[0]
    grouped = choice.reshape(num_tokens, config.n_groups, -1)
    best = 1 if config.score_function == "softmax" else min(2, grouped.shape[-1])
    group_scores = jnp.sum(jax.lax.top_k(grouped, best)[0], axis=-1)  # [T, n_groups]
    _, groups = jax.lax.top_k(group_scores, config.topk_groups)
    kept = jnp.any(groups[:, :, None] == jnp.arange(config.n_groups), axis=1)  # [T, n_groups]
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(choice.shape)


class RouterStatistics(NamedTuple):
    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    tokens_per_expert: jax.Array


def router_statistics(routing: Routing, config: RouterConfig, axis_name: str | None = None) -> RouterStatistics:
    """Losses over all tokens: those given, and with `axis_name` (inside a shard_map) those of every rank.

    load_balancing_loss = E / (K T) * sum_e count_e * P_e, where count_e is the number of tokens that chose
    expert e and P_e the mean normalised score of e: Switch Transformer's loss for softmax scores, DeepSeek's
    for sigmoid ones; 1 under perfectly uniform routing. router_z_loss = mean over tokens of
    logsumexp(logits)^2 (ST-MoE). tokens_per_expert int32 [E] counts (token, expert) assignments."""
    num_experts, num_topk = config.num_experts, config.num_experts_per_tok
    counts = jnp.sum(routing.topk_idx[..., None] == jnp.arange(num_experts), axis=(0, 1), dtype=jnp.int32)
    shares = routing.scores / jnp.sum(routing.scores, axis=-1, keepdims=True)
    mean_share = jnp.mean(shares, axis=0)
    z_loss = jnp.mean(jax.nn.logsumexp(routing.logits, axis=-1) ** 2)
    num_tokens = routing.topk_idx.shape[0]
    if axis_name is not None:  # every rank holds the same number of tokens, so means of means are means
        counts = jax.lax.psum(counts, axis_name)
        mean_share = jax.lax.pmean(mean_share, axis_name)
        z_loss = jax.lax.pmean(z_loss, axis_name)
        num_tokens *= jax.lax.axis_size(axis_name)
    balance = num_experts / (num_topk * num_tokens) * jnp.sum(counts * mean_share)
    return RouterStatistics(balance, z_loss, counts)
