"""The ``blocktable`` command line: ``blocktable demo [options]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from blocktable.demo import DemoOptions, longest_request_blocks

_DEFAULTS = DemoOptions()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one subcommand, ``demo``)."""
    parser = argparse.ArgumentParser(
        prog="blocktable", description="Paged KV-cache block tables for LLM inference."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run a small continuous-batching engine on blocktable and verify it",
        description=(
            "Run a tiny Llama through a continuous-batching engine built on blocktable "
            "(staggered arrivals, shared prompt prefixes, chunked prefill, preemption), check "
            "every request against transformers' generate, print a summary and draw the block "
            "table and pool at one step. Exit code 0 when every request matches, 1 otherwise."
        ),
    )
    demo.add_argument("--num-requests", metavar="N", type=int, default=_DEFAULTS.num_requests,
                      help="requests in the synthetic workload (>= 1; default %(default)s)")
    demo.add_argument("--seed", metavar="N", type=int, default=_DEFAULTS.seed,
                      help="seed of the model weights and of the workload (default %(default)s)")
    demo.add_argument("--block-size", metavar="TOKENS", type=int, default=_DEFAULTS.block_size,
                      help="tokens per KV-cache block (>= 1; default %(default)s)")
    demo.add_argument("--num-blocks", metavar="N", type=int, default=_DEFAULTS.num_blocks,
                      help="blocks in the KV-cache pool, null block included; small enough "
                           "forces preemptions, but the longest request must fit alone "
                           "(default %(default)s)")
    demo.add_argument("--max-new-tokens", metavar="N", type=int, default=_DEFAULTS.max_new_tokens,
                      help="tokens generated per request (>= 1; default %(default)s)")
    demo.add_argument("--token-budget", metavar="TOKENS", type=int, default=_DEFAULTS.token_budget,
                      help="most tokens computed per step; longer prompts are prefilled in "
                           "chunks (>= 1; default %(default)s)")
    demo.add_argument("--device", default=_DEFAULTS.device, choices=["cpu", "cuda"],
                      help="where the model, KV cache and table run (default %(default)s)")
    demo.add_argument("--out", metavar="PATH", type=Path, default=_DEFAULTS.out,
                      help="PNG file for the picture of the block table and pool "
                           "(default ./%(default)s)")
    demo.add_argument("--picture-step", metavar="STEP", type=int, default=None,
                      help="step to draw (default: the step with the most requests in its "
                           "batch, nearest the middle of the run)")
    demo.add_argument("--dcp", metavar="N", type=int, default=_DEFAULTS.dcp,
                      help="decode context parallelism: run N processes (1..8), each holding "
                           "its shard of every request's KV, one GPU each with --device cuda "
                           "(default %(default)s: one process)")
    demo.add_argument("--cp-interleave", metavar="TOKENS", type=int,
                      default=_DEFAULTS.cp_interleave,
                      help="with --dcp: consecutive tokens on one rank before the next rank's; "
                           "must divide --block-size (default %(default)s)")
    demo.add_argument("--quiet", action="store_true",
                      help="print only the final line (no progress or tables)")
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DemoOptions:
    for name, low in (("num_requests", 1), ("block_size", 1), ("num_blocks", 2),
                      ("max_new_tokens", 1), ("token_budget", 1), ("seed", 0)):
        value = getattr(args, name)
        if value < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if not 1 <= args.dcp <= 8:
        parser.error(f"--dcp {args.dcp} is out of range [1, 8]: one process per share of the "
                     "KV cache")
    if args.cp_interleave < 1 or args.block_size % args.cp_interleave:
        parser.error(f"--cp-interleave {args.cp_interleave} must divide --block-size "
                     f"{args.block_size}")
    if args.picture_step is not None and args.picture_step < 0:
        parser.error(f"--picture-step must be >= 0, got {args.picture_step}")
    if args.out.suffix.lower() != ".png":
        parser.error(f"--out must name a .png file, got {str(args.out)!r}")
    opts = DemoOptions(
        num_requests=args.num_requests, seed=args.seed, block_size=args.block_size,
        num_blocks=args.num_blocks, max_new_tokens=args.max_new_tokens,
        token_budget=args.token_budget, device=args.device, out=args.out,
        picture_step=args.picture_step, quiet=args.quiet, dcp=args.dcp,
        cp_interleave=args.cp_interleave,
    )
    need = longest_request_blocks(opts)
    if need > opts.num_blocks - 1:
        parser.error(
            f"--num-blocks {opts.num_blocks} is too small: the longest request needs {need} "
            f"blocks of {opts.block_size * opts.dcp} tokens, plus the null block "
            f"(use >= {need + 1})"
        )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible")
        if torch.cuda.device_count() < args.dcp:
            parser.error(f"--dcp {args.dcp} needs {args.dcp} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``blocktable`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from blocktable.demo import run_demo

        return run_demo(_validate(parser, args))
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects it
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
