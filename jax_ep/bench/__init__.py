"""Benchmarks: `python -m jax_ep.bench MODE [options]` (`python -m jax_ep.bench MODE --help` for a mode's own).

Modes, one module each beside the shared harness (jax_ep/bench/harness.py):
  intranode       normal-mode dispatch and combine over the GPUs of one host, DeepEP's shape and byte count
  internode       the internode normal mode, one process per GPU (--processes N --ranks-per-node P)
  low_latency     low-latency dispatch and combine at DeepEP's decode shape, with the kernels' own clocks
  grouped_matmul  jax_ep.grouped_matmul in an expert SwiGLU, forward + backward, beside a dense chain
  moe             the jax_ep.flax.MoE block, forward + backward, beside the dense proxy of its FLOPs, and its
                  breakdown (router, dispatch, expert FFN, combine)
  overlap         an expert-major dispatch + combine on a jax_ep side stream beside the expert matmuls
  soak            many jitted dispatch + combine (or MoE block) steps: memory growth and bit-for-bit repeatability
Every mode takes --json PATH (every figure); intranode and moe draw --plot PATH.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from jax_ep.bench import harness

MODES = ("intranode", "internode", "low_latency", "grouped_matmul", "moe", "overlap", "soak")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m jax_ep.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the mode's options (MODE --help lists them)")
    name = parser.parse_args(argv).mode
    # Imported by name, when chosen: a mode's needs (flax for moe, the CUDA backends for the others) are its own.
    mode = importlib.import_module(f"jax_ep.bench.{name}")
    mode_parser = harness.mode_parser(name, mode.__doc__)
    mode.add_arguments(mode_parser)
    return harness.run(mode, mode_parser.parse_args(argv[1:]), argv, mode_parser)
