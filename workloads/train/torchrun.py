"""The same training loop without Ray: `torchrun --nproc-per-node N -m workloads.train.torchrun`.

Used for GPU checks on machines without Ray and to measure Ray Train's overhead against
plain torch.distributed (bench/). Takes the driver's flags; checkpoints go to --output.
"""

from __future__ import annotations

import json
import os
import sys

from workloads.common.cli import run_main
from workloads.train.driver import build_parser, validate_args
from workloads.train.checkpoint import read_history
from workloads.train.loop import LoopConfig, train_loop

PROG = "workloads.train.torchrun"


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    parser.prog = PROG
    parser.add_argument("--output", default="runs/torchrun", help="checkpoint folder")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.num_workers = world
    model = validate_args(args)
    from workloads.train.context import TorchrunContext

    ctx = TorchrunContext(args.output, keep=args.num_to_keep)
    cfg = LoopConfig(model=model.to_dict(), strategy=args.strategy, zero_stage=args.zero_stage,
                     offload=args.offload, batch_size=args.batch_size,
                     grad_accum=args.grad_accum, lr=args.lr * world,
                     warmup_steps=args.warmup_steps if args.warmup_steps is not None
                     else max(1, min(100, args.max_steps // 10)),
                     max_steps=args.max_steps, checkpoint_every=args.checkpoint_every,
                     log_every=args.log_every, corpus_bytes=args.corpus_bytes, seed=args.seed,
                     compile=args.compile,
                     # As the Ray driver: a DataLoader process only beside a GPU.
                     num_workers=1 if ctx.device.type == "cuda" else 0)
    final = train_loop(cfg, ctx)
    if ctx.rank == 0:
        # Every logged step, from the metrics history the final checkpoint carries.
        with ctx.latest_checkpoint() as d:
            history = read_history((d / "metrics.csv").read_text()) if d else ctx.reports
        print("RAYFLEET_SUMMARY " + json.dumps({"world_size": world, "device": str(ctx.device),
                                                "history": history, **final}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
