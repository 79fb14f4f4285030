"""``python -m epmoe run ...``: the ``epmoe`` command-line tool from Python.

``run`` executes the same C++ code as ``epmoe run`` (tools/run.cpp is compiled into the module):
one MoE layer of a real model on every rank (CPU executor: one thread per rank), random weights
and inputs, each round checked against the emulating reference and the float64 forward. The exit
status is the tool's: 0 pass, 1 mismatch, 2 error.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import Error, _epmoe


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m epmoe", description="epmoe: expert-parallel MoE layer")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run}")
    run = commands.add_parser(
        "run",
        help="run one MoE layer of a real model on every rank and check it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    models = " | ".join(m.name for m in _epmoe.known_models())
    run.add_argument("--model", default="qwen3-30b-a3b", help=models)
    run.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks")
    run.add_argument("--tokens", type=int, default=8, help="tokens per rank per round")
    run.add_argument(
        "--experts",
        type=int,
        default=0,
        help="override the number of experts (0 = the model's); the CPU executor holds every "
        "expert in host memory",
    )
    run.add_argument("--precision", default="bf16", help="bf16 | mxfp8 | nvfp4 | fp8_block128 | mxfp4")
    run.add_argument("--combine", default="staged", help="staged | in_kernel_reduce")
    run.add_argument(
        "--math",
        default="wgmma",
        help="expert math: exact | tensor_core | wgmma (tensor_core: bf16 mma.sync, fp32 "
        "accumulation; wgmma: Hopper TMA + WGMMA grouped GEMMs, bf16 operands or E4M3 for "
        "fp8_block128; CUDA executor only, the CPU executor always computes exactly)",
    )
    run.add_argument("--executor", default="auto", help="auto | cpu | cuda")
    run.add_argument("--rounds", type=int, default=2, help="rounds to run (each checked)")
    run.add_argument(
        "--check-tokens",
        type=int,
        default=-1,
        help="tokens per rank per round checked against the references (the first N); -1 = all "
        "while that stays quick on the host (<= 4 G multiply-adds per rank per round), else as "
        "many as fit (deepseek-v3: 11)",
    )
    run.add_argument("--seed", type=int, default=1, help="seed of weights, inputs and routing")
    run.add_argument(
        "--timeout-ms", type=int, default=10_000, help="bounded-wait timeout, 0 = forever"
    )
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    sys.stdout.flush()
    try:
        if args.command == "run":
            return _epmoe._run_command(
                model=args.model,
                ranks=args.ranks,
                tokens=args.tokens,
                experts=args.experts,
                precision=args.precision,
                combine=args.combine,
                executor=args.executor,
                rounds=args.rounds,
                seed=args.seed,
                timeout_ms=args.timeout_ms,
                math=args.math,
                check_tokens=args.check_tokens,
            )
    except Error as e:
        print(f"epmoe: error ({e.code}): {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
