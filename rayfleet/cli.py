"""The `rayfleet` command. Each subcommand exits 0 on success and, on an expected failure,
prints one line to stderr and exits 2 (DESIGN convention 6)."""

from __future__ import annotations

import argparse
import sys

from rayfleet.errors import RayfleetError


def _local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="a real single-machine Ray cluster with token auth")
    lsub = p.add_subparsers(dest="action", required=True, metavar="{up,down,status,env}")
    up = lsub.add_parser("up", help="start the head (idempotent)")
    up.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule "
                    "(default: all cores)")
    up.add_argument("--num-gpus", type=int, default=None, help="GPUs Ray may schedule")
    up.add_argument("--object-store-memory", default=None, metavar="SIZE",
                    help="object store size, e.g. 2GB (raise it on ObjectStoreFullError)")
    up.add_argument("--port", type=int, default=6379, help="GCS port (default 6379)")
    up.add_argument("--dashboard-port", type=int, default=8265,
                    help="dashboard and Jobs API port on 127.0.0.1 (default 8265)")
    lsub.add_parser("down", help="stop the cluster `up` started, and only it")
    lsub.add_parser("status", help="nodes (ALIVE/DEAD) and free CPUs/GPUs/memory")
    env = lsub.add_parser("env", help='shell exports for clients: eval "$(rayfleet local env)"')
    env.add_argument("--shell", choices=["sh", "fish"], default="sh")


def _run_local(args: argparse.Namespace) -> int:
    from rayfleet import local

    if args.action == "up":
        local.up(num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                 object_store_memory=args.object_store_memory, port=args.port,
                 dashboard_port=args.dashboard_port)
        return 0
    if args.action == "down":
        local.down()
        return 0
    if args.action == "status":
        return local.status()
    if args.action == "env":
        print("\n".join(local.env_lines(args.shell)))
        return 0
    raise AssertionError(args.action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayfleet",
        description="Hardened Ray clusters on AWS A100s, and locally, for training, data "
                    "pipelines and serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _local(sub)
    return parser


HANDLERS = {"local": _run_local}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except RayfleetError as err:
        print(f"rayfleet: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("rayfleet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
