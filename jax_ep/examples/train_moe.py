"""`python -m jax_ep.examples.train_moe`: a small decoder-only MoE language model trained with optax on
generated data, once per dispatcher of jax_ep.flax.MoE, on every device present (8 virtual CPU devices
without a GPU). A progress bar per dispatcher shows the loss; a summary line follows each run, and the loss
curves are drawn to loss.png (--plot PATH elsewhere, --no-plot not at all).

The data: each sequence starts with a rule token that names one of a few fixed random permutations of the
other tokens; then comes a random token and, after it, each token is the rule's permutation of the one
before. The model must learn the permutations and look back at the rule token (attention), so the loss falls
from log(vocab) towards the one unpredictable token per sequence.

The block's own benchmark (forward + backward per dispatcher, beside the dense proxy of its FLOPs) is
`python -m jax_ep.bench moe`."""
from __future__ import annotations

from jax_ep import environment

environment.virtual_cpu_devices(8)  # before JAX starts its CPU backend (at first use); GPUs ignore it

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_ep.flax import MoE, MoEAux  # noqa: E402

NUM_RULES = 4  # rule tokens 0..3; the other tokens are data


class Block(nnx.Module):
    """Pre-norm decoder block: causal self-attention, then the expert-parallel MoE."""

    def __init__(self, args, moe_kwargs: dict, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(args.heads, args.d_model, use_bias=False, decode=False, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.moe = MoE(args.d_model, args.d_ff, args.experts, args.topk, **moe_kwargs, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.attention_norm(x), mask=mask)
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux


class LanguageModel(nnx.Module):
    def __init__(self, args, moe_kwargs: dict, *, rngs: nnx.Rngs):
        self.token_embedding = nnx.Embed(args.vocab, args.d_model, rngs=rngs)
        self.position_embedding = nnx.Embed(args.seq, args.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(args, moe_kwargs, rngs=rngs) for _ in range(args.layers)])
        self.final_norm = nnx.RMSNorm(args.d_model, rngs=rngs)
        self.lm_head = nnx.Linear(args.d_model, args.vocab, use_bias=False, rngs=rngs)
        self.remat = args.remat

    def __call__(self, tokens) -> tuple[jax.Array, MoEAux]:
        """tokens int32 [B, S] -> logits [B, S, vocab] and the MoE statistics summed over the blocks."""
        x = self.token_embedding(tokens) + self.position_embedding(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        block_call = nnx.remat(Block.__call__) if self.remat else Block.__call__
        totals = None
        for block in self.blocks:
            x, aux = block_call(block, x, mask)
            totals = aux if totals is None else jax.tree.map(jnp.add, totals, aux)
        return self.lm_head(self.final_norm(x)), totals


def make_rules(vocab: int, seed: int) -> np.ndarray:
    """int32 [NUM_RULES, vocab]: each rule a random permutation of the data tokens (rule tokens map to 0)."""
    rng = np.random.default_rng(seed)
    rules = np.zeros((NUM_RULES, vocab), np.int32)
    for rule in rules:
        rule[NUM_RULES:] = NUM_RULES + rng.permutation(vocab - NUM_RULES)
    return rules


def make_batch(rules: np.ndarray, batch: int, seq: int, step: int) -> np.ndarray:
    """int32 [batch, seq], the same for a given step in every run."""
    rng = np.random.default_rng(step)
    rule = rng.integers(0, NUM_RULES, batch)
    tokens = np.empty((batch, seq), np.int32)
    tokens[:, 0] = rule
    tokens[:, 1] = rng.integers(NUM_RULES, rules.shape[1], batch)
    for t in range(2, seq):
        tokens[:, t] = rules[rule, tokens[:, t - 1]]
    return tokens


class Progress:
    """A progress bar with the latest loss in its postfix: tqdm's (the `examples` and `test` extras install it);
    where tqdm is missing (e.g. an install with --no-deps), one text line redrawn in place."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.total, self.desc, self.done = total, desc, 0
        self.bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True) if tqdm is not None else None

    def update(self, loss: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)
            return
        width = 30
        filled = width * self.done // self.total
        print(f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} loss={loss:.4f}",
              end="", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print(flush=True)


def moe_options(args, dispatcher: str, mesh: Mesh, tokens_per_rank: int) -> dict:
    return dict(mesh=mesh, dispatcher=dispatcher, backend=args.backend, max_tokens_per_rank=tokens_per_rank,
                capacity_factor=args.capacity_factor if dispatcher in ("normal", "xla") else None)


def train(args, dispatcher: str, mesh: Mesh) -> list[float]:
    """Trains a fresh model (the same initial weights and data for every dispatcher); returns the losses."""
    num_ranks = mesh.shape["ep"]
    model = LanguageModel(args, moe_options(args, dispatcher, mesh, args.batch * args.seq // num_ranks),
                          rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    # Experts (and their optimizer moments) sharded over "ep" by their partition metadata, everything else
    # replicated: the shardings the train step returns, so that its second call does not compile again.
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, nnx.get_named_sharding(state, mesh)))

    def loss_fn(model, tokens):
        logits, aux = model(tokens)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
        return cross_entropy + args.balance_coef * aux.load_balancing_loss + args.z_coef * aux.router_z_loss

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    rules = make_rules(args.vocab, args.seed)
    batch_sharding = NamedSharding(mesh, P("ep"))
    progress = Progress(args.steps, dispatcher)
    losses, start = [], None
    for step in range(args.steps):
        tokens = jax.device_put(make_batch(rules, args.batch, args.seq, step), batch_sharding)
        losses.append(float(train_step(model, optimizer, tokens)))
        progress.update(losses[-1])
        if step == 0:
            start = time.perf_counter()  # time the steps after the first, which compiles
    progress.close()
    if losses:
        timing = (f"{(time.perf_counter() - start) / (args.steps - 1) * 1e3:.1f} ms/step after compilation, "
                  if args.steps > 1 else "")
        print(f"{dispatcher}: {args.steps} steps, {timing}loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return losses


# Line style and marker per dispatcher: the dispatchers' curves often lie on top of each other, so each must
# stay visible under the others (hollow markers of decreasing size, staggered along the curve).
CURVE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def plot(losses: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib, or pass --no-plot)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (dispatcher, curve) in enumerate(losses.items()):
        linestyle, marker = CURVE_STYLES[i % len(CURVE_STYLES)]
        every = max(1, len(curve) // 15)
        ax.plot(np.arange(1, len(curve) + 1), curve, label=dispatcher, linestyle=linestyle, marker=marker,
                markevery=(i * every // len(losses), every), markerfacecolor="none", markersize=max(3, 9 - 2 * i),
                linewidth=1.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("MoE language model, jax_ep.flax.MoE dispatchers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv=None):
    on_gpu = jax.devices()[0].platform == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dispatchers", default="normal,xla,none" if on_gpu else "xla,none",
                        help="comma list of normal, xla, low_latency, none")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "xla"],
                        help="the jax_ep backend of the 'normal' dispatcher")
    parser.add_argument("--plot", metavar="PATH", default="loss.png", help="write a PNG of the loss curves here "
                        "(default: %(default)s)")
    parser.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="write no plot")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (a multiple of the device count)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=128, help="a multiple of 128")
    parser.add_argument("--d-ff", type=int, default=128, help="expert FFN width")
    parser.add_argument("--experts", type=int, default=16, help="a multiple of the device count")
    parser.add_argument("--topk", type=int, default=2, help="experts per token")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float,
                        help="for the normal and xla dispatchers (default: no capacity limit)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--balance-coef", type=float, default=1e-2, help="weight of the load-balancing loss")
    parser.add_argument("--z-coef", type=float, default=1e-3, help="weight of the router z-loss")
    parser.add_argument("--remat", action="store_true", help="rematerialise each block in the backward pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dispatchers = [d for d in args.dispatchers.split(",") if d]
    return args


def main(argv=None) -> dict:
    """Returns {dispatcher: losses}."""
    args = parse_args(argv)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("ep",))
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind})")
    losses = {dispatcher: train(args, dispatcher, mesh) for dispatcher in args.dispatchers}
    first, *others = args.dispatchers
    for dispatcher in others:
        gap = np.max(np.abs(np.subtract(losses[dispatcher], losses[first])))
        print(f"{dispatcher} vs {first}: largest loss difference {gap:.2e} over {args.steps} steps")
    if args.plot:
        plot(losses, args.plot)
    return losses


if __name__ == "__main__":
    main()
