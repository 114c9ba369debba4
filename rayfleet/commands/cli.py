"""The `rayfleet` command. Every subcommand exits 0 when all is well, 1 on findings (lint's
and preflight's, sweep's leftovers, cost over budget), and 2 on bad input with one line on
stderr, no traceback; a command that reads a cluster YAML takes it first, as CLUSTER_YAML
(docs/cli.md)."""

from __future__ import annotations

import argparse
import math
import sys

from rayfleet.commands import (cliargs, cloudenv, cost, keypair, lint, local, logs, preflight,
                               render, serve_config, status, sweep)
from rayfleet.entrypoint import ArgumentParser, UsageError, at_least, bounded, run_main, tcp_port
from rayfleet.facts import VLLM_BUILDS, loopback_port, port
from rayfleet.ingress import DEFAULT_INGRESS, INGRESS_CHOICES


def _local(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("local", help="a real single-machine Ray cluster with token auth")
    lsub = p.add_subparsers(dest="action", required=True, metavar="{up,down,status,env}")
    up = lsub.add_parser("up", help="start the head (idempotent)")
    up.add_argument("--num-cpus", type=at_least(1), default=None, help="CPUs Ray may schedule "
                    "(default: all cores)")
    up.add_argument("--num-gpus", type=at_least(0), default=None, help="GPUs Ray may schedule")
    up.add_argument("--object-store-memory", default=None, metavar="SIZE",
                    help="object store size, e.g. 2GB (raise it on ObjectStoreFullError)")
    up.add_argument("--port", type=tcp_port, default=None, help=f"GCS port (default {port('gcs')})")
    up.add_argument("--dashboard-port", type=tcp_port, default=None,
                    help=f"dashboard and Jobs API port on 127.0.0.1 (default {port('dashboard')})")
    up.add_argument("--python", default=None, metavar="PATH",
                    help="interpreter of the environment Ray and its jobs run in (default: "
                         "this one); it must hold the node environment")
    up.add_argument("--metrics", action="store_true",
                    help="also run Prometheus scraping the cluster (installs Debian's "
                         "prometheus when missing); on a running cluster, starts it for it")
    up.add_argument("--prometheus-port", type=tcp_port, default=None,
                    help="Prometheus's port on 127.0.0.1 (default "
                         f"{loopback_port('prometheus')})")
    up.add_argument("--ingress", choices=INGRESS_CHOICES, default=None,
                    help="Serve's ingress on the cluster: haproxy (default; stats and "
                         "exporter on loopback, docs/workloads.md) or python (Serve's own "
                         "proxy)")
    up.add_argument("--ha", action="store_true",
                    help="GCS fault tolerance: the GCS's tables in a Redis on 127.0.0.1 "
                         "(Debian's redis-server, password in a 0600 file) and gcs_server "
                         "started again by the head's supervisor when it dies "
                         "(docs/faults.md)")
    lsub.add_parser("down", help="stop the cluster `up` started (its Prometheus and Redis "
                                 "too), only it")
    lsub.add_parser("status", help="nodes (ALIVE/DEAD) and free CPUs/GPUs/memory")
    env = lsub.add_parser("env", help='shell exports for clients: eval "$(rayfleet local env)"')
    env.add_argument("--shell", choices=["sh", "fish"], default="sh")


def _run_local(args: argparse.Namespace) -> int:
    if args.action == "up":
        local.up(num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                 object_store_memory=args.object_store_memory, port=args.port,
                 dashboard_port=args.dashboard_port, python=args.python,
                 metrics=args.metrics, prometheus_port=args.prometheus_port,
                 ingress=args.ingress, ha=args.ha)
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
    parser = ArgumentParser(
        prog="rayfleet", help_hint=True,
        description="Hardened Ray clusters on AWS A100s, and locally, for training, data "
                    "pipelines and serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    _local(sub)
    _render(sub)
    _checks(sub)
    _serve_config(sub)
    _logs(sub)
    _status(sub)
    _env(sub)
    return parser


def _render(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="stack outputs -> cluster-configs/generated/<stack>.yaml")
    p.add_argument("outputs", help="`pulumi stack output --json` saved to a file, or - for stdin")
    cliargs.output(p, "where to write (default cluster-configs/generated/<stack>.yaml)")
    p.add_argument("--token-file", default=None,
                   help="local Ray auth token shipped to every node (default "
                        "$RAYFLEET_HOME or ~/.rayfleet, /clusters/<cluster>/auth_token; "
                        "created 0600 if missing)")
    p.add_argument("--key-name", default=None,
                   help="existing EC2 key pair for SSH over SSM (default <cluster>-operator)")
    p.add_argument("--idle-timeout", type=at_least(1, unit="minute"), default=10,
                   metavar="MINUTES",
                   help="minutes before an idle worker is terminated (default 10)")
    p.add_argument("--no-create-token", action="store_true",
                   help="do not create the token file if it is missing")
    p.add_argument("--autostop-minutes",
                   type=bounded(int, lambda m: m >= 0, "0 (never) or more minutes"),
                   default=None, metavar="MINUTES",
                   help="tear the whole cluster down, head included, once it has been idle "
                        "this long: no job, Serve app or user actor; 0: never (default: the "
                        "stack's rayfleet:autostopMinutes, 0 unless set)")
    p.add_argument("--metrics", action="store_true",
                   help="run Prometheus on the head's loopback, scraping Ray's metrics "
                        "(reach it with `rayfleet env <yaml>`: $RAYFLEET_METRICS_URL, a "
                        f"tunnel to the head's {loopback_port('prometheus')})")
    p.add_argument("--vllm", choices=VLLM_BUILDS, default=None,
                   help="the vLLM the head and the GPU workers get, for the llm Serve app: "
                        "cuda (pyproject.toml's llm extra), cpu (its llm-cpu extra, "
                        "vLLM's CPU build, for nodes without GPUs), none (nodes set up faster, "
                        "and the llm app cannot run) (default: the stack's rayfleet:vllm, "
                        "cuda unless set)")
    p.add_argument("--ingress", choices=INGRESS_CHOICES, default=DEFAULT_INGRESS,
                   help="Serve's ingress on every node: haproxy (default; through the kit's "
                        "guard, nothing on the world) or python (Serve's own proxy)")


def _checks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lint", help="check any Ray cluster YAML against the security rules "
                                    "(exit 1 on an error)")
    cliargs.cluster_yaml(p, "Ray cluster-launcher YAML")

    p = sub.add_parser("cost", help="$/hour and $/month of a cluster YAML (offline price "
                                    "table; exit 1 over budget)")
    cliargs.cluster_yaml(p, "Ray cluster-launcher YAML")
    p.add_argument("--stack-file", default=None,
                   help="Pulumi.<stack>.yaml whose rayfleet:budgetMonthlyUsd to compare with")
    p.add_argument("--budget-usd",
                   type=bounded(float, lambda usd: 0 < usd < math.inf,
                                "a positive amount of USD"),
                   default=None, help="monthly budget in USD")
    p.add_argument("--hours-per-month",
                   type=bounded(float, lambda h: 0 < h <= cost.MAX_HOURS_PER_MONTH,
                                f"between 0 and {cost.MAX_HOURS_PER_MONTH}"),
                   default=cost.HOURS_PER_MONTH,
                   help=f"hours a month the cluster runs (default {cost.HOURS_PER_MONTH:g}, "
                        "always on)")

    p = sub.add_parser("sweep", help="find (and with --delete remove) what a cluster left "
                                     "behind after `ray down` (exit 1 while any is left)",
                       usage="rayfleet sweep [-h] CLUSTER_YAML [--delete]\n"
                             "       rayfleet sweep [-h] --cluster-name NAME --region REGION "
                             "[--delete]")
    cliargs.cluster_yaml(p, "the cluster's YAML: its cluster_name and provider.region say what "
                            "to look for, and where", optional=True)
    p.add_argument("--cluster-name", default=None, metavar="NAME",
                   help="without a YAML: the cluster's name (--region is then required)")
    p.add_argument("--region", default=None,
                   help="without a YAML: the cluster's AWS region (never the AWS profile's)")
    p.add_argument("--delete", action="store_true", help="remove what is found")

    p = sub.add_parser("preflight", help="check the AWS account can launch a cluster YAML "
                                         "(exit 1 if a check fails)")
    cliargs.cluster_yaml(p, "Ray cluster-launcher YAML")
    p.add_argument("--num-gpus", type=at_least(0), default=None,
                   help="GPUs one job's worker asks for: some node type must offer them")
    p.add_argument("--bucket", default=None,
                   help="s3://bucket/prefix to check reachable and writable (default: render's "
                        "facts beside the YAML)")
    preflight.add_arguments(p)

    p = sub.add_parser("keypair", help="create the SSH key pair a cluster YAML names, in EC2 "
                                       "and at its auth.ssh_private_key (0600), once")
    cliargs.cluster_yaml(p, "the YAML `rayfleet render` wrote: its node types' KeyName, "
                            "provider.region and auth.ssh_private_key")


def _serve_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-config", help="a Serve config checked (and, for a remote "
                                            "cluster, its code packaged) before serve deploy")
    p.add_argument("config", nargs="+", help="Serve config, e.g. cluster-configs/serve/lm.yaml; "
                   "several: one file with all their apps")
    p.add_argument("--package-to", default=None, metavar="URI",
                   help="remote cluster: s3://BUCKET/PREFIX every node can read (the stack's "
                        "bucket), or file:///PATH on storage the nodes share; without it, "
                        "for a cluster on this machine: the args are checked here instead")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="set an application arg, e.g. checkpoint=s3://... (repeatable); "
                   "APP.KEY=VALUE for one app of several")
    p.add_argument("--working-dir", default=".", help="the code to package (default .)")
    cliargs.output(p, "where to write (default cluster-configs/generated/serve-<name>.yaml)")


def _run_render(args: argparse.Namespace) -> int:
    out = cliargs.output_of(args, "rayfleet render OUTPUTS")
    path = render.render(args.outputs, out=out, token_file=args.token_file,
                         key_name=args.key_name, idle_timeout_minutes=args.idle_timeout,
                         create_token=not args.no_create_token,
                         autostop_minutes=args.autostop_minutes, metrics=args.metrics,
                         vllm=args.vllm, ingress=args.ingress)
    print(f"wrote {path}")
    return 0


def _run_lint(args: argparse.Namespace) -> int:
    return lint.main(args.cluster_yaml)


def _run_cost(args: argparse.Namespace) -> int:
    return cost.main(args.cluster_yaml, stack_file=args.stack_file, budget_usd=args.budget_usd,
                     hours_per_month=args.hours_per_month)


def _run_sweep(args: argparse.Namespace) -> int:
    return sweep.main(args.cluster_name, region=args.region, delete_=args.delete,
                      cluster_yaml=args.cluster_yaml)


def _run_preflight(args: argparse.Namespace) -> int:
    return preflight.main(args.cluster_yaml, num_gpus=args.num_gpus, bucket=args.bucket,
                          hours=args.hours)


def _run_keypair(args: argparse.Namespace) -> int:
    return keypair.main(args.cluster_yaml)


def _run_serve_config(args: argparse.Namespace) -> int:
    out = cliargs.output_of(args, f"rayfleet serve-config {' '.join(args.config)}")
    if args.package_to is None:
        path = serve_config.checked_config(args.config, arg_pairs=args.arg, out=out)
    else:
        path = serve_config.serve_config(args.config, args.package_to,
                                         working_dir=args.working_dir, arg_pairs=args.arg,
                                         out=out)
    print(f"wrote {path}\nNext: serve deploy {path}")
    return 0


def _logs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="a run's job logs, metrics and loss curve from the stack's "
                                    "bucket, also after `ray down`",
                       usage="rayfleet logs [-h] CLUSTER_YAML [RUN] [options]\n"
                             "       rayfleet logs [-h] --storage s3://BUCKET/PREFIX [RUN] "
                             "[options]")
    # Two optional positionals, sorted out by logs.positionals: with --storage the one
    # argument is the run.
    p.add_argument("cluster_yaml", nargs="?", default=None, metavar="CLUSTER_YAML",
                   help="the YAML `rayfleet render` wrote: the stack's storage is read from "
                        "render's facts beside it")
    p.add_argument("run", nargs="?", default=None, metavar="RUN",
                   help="the run: its job's submission id (or a training --name)")
    p.add_argument("--storage", default=None, metavar="s3://BUCKET/PREFIX",
                   help="instead of a YAML: the stack's storage; then the one argument is "
                        "the run")
    cliargs.old_config(p)
    p.add_argument("--list", action="store_true", help="list the run's files with sizes")
    p.add_argument("--file", default=None, metavar="NAME",
                   help="print one file, e.g. logs/driver.log, metrics.csv, a worker log's name")
    cliargs.output(p, "with --file: write it to PATH instead (loss.png)")
    p.add_argument("--cluster", default=None, metavar="NAME",
                   help="instead of a run: the autostop watcher's log of cluster NAME")


def _run_logs(args: argparse.Namespace) -> int:
    if args.config is None:
        config, run = logs.positionals(args.cluster_yaml, args.run, args.storage)
    elif args.run is not None:
        raise UsageError("with --config the one argument is the run: rayfleet logs "
                         "CLUSTER_YAML [RUN]")
    else:
        cliargs.deprecated("--config", "rayfleet logs CLUSTER_YAML [RUN]")
        config, run = args.config, args.cluster_yaml
    out_path = cliargs.output_of(args, "rayfleet logs CLUSTER_YAML RUN --file NAME")
    return logs.main(run, storage=args.storage, config=config, list_=args.list,
                     file=args.file, out_path=out_path, cluster=args.cluster)


def _status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="per worker node type of a launched cluster: running, "
                                      "pending, the last launch error and its AWS reason")
    cliargs.cluster_yaml(p, "the YAML `rayfleet render` wrote: its node types in order, its "
                            "token", optional=True)
    cliargs.old_config(p)
    p.add_argument("--address", default=None, metavar="URL",
                   help="the dashboard through `rayfleet env <cluster.yaml>`'s tunnel "
                        f"(default: RAY_ADDRESS if http://, else {status.DEFAULT_ADDRESS})")


def _run_status(args: argparse.Namespace) -> int:
    config = cliargs.config_of(args, "rayfleet status CLUSTER_YAML")
    return status.main(address=args.address, config=config)


def _env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="shell exports for a cluster `ray up` launched, through "
                                   'background tunnels: eval "$(rayfleet env CLUSTER_YAML)"',
                       usage="rayfleet env [-h] CLUSTER_YAML [--shell {sh,fish}] "
                             "[--timeout SECONDS]\n"
                             "       rayfleet env [-h] CLUSTER_YAML --close")
    cliargs.cluster_yaml(p, "the YAML `rayfleet render` wrote and `ray up` launched: the "
                            "cluster's name, token, region and run store are read from it and "
                            "render's facts beside it")
    p.add_argument("--shell", choices=["sh", "fish"], default="sh")
    p.add_argument("--timeout", type=at_least(1, float, "second"), default=cloudenv.WAIT_S,
                   metavar="SECONDS",
                   help=f"how long the tunnels get to answer (default {cloudenv.WAIT_S:g})")
    p.add_argument("--close", action="store_true",
                   help="stop the tunnels this command opened for the cluster, and only them")


def _run_env(args: argparse.Namespace) -> int:
    if args.close:
        return cloudenv.close(args.cluster_yaml)
    return cloudenv.env(args.cluster_yaml, shell=args.shell, timeout=args.timeout)


HANDLERS = {"local": _run_local, "render": _run_render, "lint": _run_lint,
            "cost": _run_cost, "sweep": _run_sweep, "preflight": _run_preflight,
            "keypair": _run_keypair,
            "serve-config": _run_serve_config, "logs": _run_logs,
            "status": _run_status, "env": _run_env}


def _main(argv: list[str] | None) -> int:
    # Subparsers inherit the parser class, so every subcommand's flags answer in one line.
    args = build_parser().parse_args(argv)
    return HANDLERS[args.command](args)


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv, "rayfleet")


if __name__ == "__main__":
    sys.exit(main())
