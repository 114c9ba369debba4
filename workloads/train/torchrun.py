"""The same training loop without Ray: `torchrun --nproc-per-node N -m workloads.train.torchrun`.

Used for GPU checks on machines without Ray and to measure Ray Train's overhead against
plain torch.distributed (bench/). Takes the driver's flags; checkpoints go to --output.
"""

from __future__ import annotations

import json
import os
import sys

from rayfleet.entrypoint import run_main
from rayfleet.errors import ConfigError
from workloads.common.runs import METRICS, read_history
from workloads.train.context import TorchrunContext
from workloads.train.inputs import absolute_hf_paths, loop_config, prepare_inputs
from workloads.train.loop import train_loop
from workloads.train.options import TrainOptions, build_parser, check_options

PROG = "workloads.train.torchrun"


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    parser.prog = PROG
    parser.add_argument("--output", default="runs/torchrun", help="checkpoint folder")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    opts = TrainOptions.from_args(args, num_workers=world)
    model = check_options(opts)
    opts = absolute_hf_paths(opts)
    if opts.dataset not in (None, "stdlib") and opts.dataset.startswith("s3://"):
        raise ConfigError("--dataset", "torchrun reads a local dataset folder (Ray Train "
                                       "streams s3:// ones)")
    model, hf_source, tokenizer = prepare_inputs(opts, model)
    ctx = TorchrunContext(args.output, keep=opts.num_to_keep)
    # As the Ray driver: a DataLoader process only beside a GPU.
    cfg = loop_config(opts, model, hf_source, tokenizer, world,
                      data_workers=1 if ctx.device.type == "cuda" else 0, ray_dataset=False)
    final = train_loop(cfg, ctx)
    if ctx.rank == 0:
        # Every logged step, from the metrics history the final checkpoint carries.
        with ctx.latest_checkpoint() as d:
            history = read_history((d / METRICS).read_text()) if d else ctx.reports
        print("RAYFLEET_SUMMARY " + json.dumps({"world_size": world, "device": str(ctx.device),
                                                "history": history, **final}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
