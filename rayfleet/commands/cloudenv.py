"""`rayfleet env CLUSTER_YAML [--close]`: the cloud counterpart of `rayfleet local env`.

``eval "$(rayfleet env cluster-configs/generated/<stack>.yaml)"`` opens (or finds still open)
background tunnels to the head of the cluster `ray up` launched from that YAML, one
``ray dashboard --port L --remote-port R CLUSTER_YAML`` each (rayfleet/commands/tunnels.py):
the dashboard and Jobs API, Serve's HTTP ingress and, when the YAML was rendered with
``--metrics``, Prometheus; then prints the shell exports that make the local quickstart's lines
work against it: ``ray job submit``, ``serve deploy``, the ``openai`` client at
``$RAYFLEET_SERVE_URL/v1``. The token is the one `rayfleet render` wrote for the cluster (never
printed), the run store and region are render's facts. ``--close`` stops the tunnels, and
only processes this command started.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayfleet import clusteryaml, runstore
from rayfleet.commands import tunnels
from rayfleet.commands import metrics as prometheus
from rayfleet.commands.host import free_ports, no_proxy_with
from rayfleet.commands.localstate import auth_env, export_lines
from rayfleet.commands.render import default_token_file
from rayfleet.commands.tunnels import NOT_YET, OK, REFUSED, Tunnel
from rayfleet.errors import ClusterError, ConfigError
from rayfleet.facts import port

# How long the tunnels get to answer (--timeout): `ray dashboard` finds the head through EC2,
# then opens its SSH session over SSM.
WAIT_S = 60.0
DASHBOARD, SERVE, METRICS = "dashboard", "serve", "metrics"
# What each tunnel forwards, in words (progress lines).
WHAT = {DASHBOARD: "dashboard and Jobs API", SERVE: "Serve's HTTP ingress",
        METRICS: "Prometheus"}
# The exports beyond Ray's own: where Serve's apps and Prometheus answer here.
SERVE_URL_ENV = "RAYFLEET_SERVE_URL"
METRICS_URL_ENV = "RAYFLEET_METRICS_URL"


@dataclass(frozen=True)
class Target:
    """A launched cluster as its YAML and render's facts say: what to forward and with what."""

    cluster_yaml: Path          # absolute
    cluster: str
    folder: Path                # the cluster's state folder here (tunnels' record and logs)
    token_file: Path
    region: str | None
    storage: str | None         # the run store (RAYFLEET_STORAGE), None: render's facts lack it
    packages: str | None        # Serve's code packages (RAYFLEET_PACKAGES), as storage
    remote: dict[str, int]      # role -> port on the head's loopback


def cluster_folder(cluster: str) -> Path:
    """The cluster's state folder: where `rayfleet render` keeps its token by default
    ($RAYFLEET_HOME or ~/.rayfleet, /clusters/<cluster>)."""
    return Path(default_token_file(cluster)).expanduser().parent


def metrics_port(cfg: dict[str, Any]) -> int | None:
    """The port of the Prometheus `rayfleet render --metrics` starts on the head (its start
    command among the head's), None when the YAML was rendered without it."""
    listen = prometheus.prometheus_args("prometheus", "", "", 0)[-1].rsplit(":", 1)[0] + ":"
    for cmd in cfg.get("head_start_ray_commands") or []:
        if isinstance(cmd, str) and prometheus.NODE_HOME_DIR in cmd and listen in cmd:
            found = re.match(r"\d+", cmd.split(listen, 1)[1])
            if found:
                return int(found.group())
    return None


def _cluster_name(cfg: dict[str, Any], path: str) -> str:
    name = cfg.get("cluster_name")
    if not isinstance(name, str) or not name:
        raise ConfigError("CLUSTER_YAML", f"{path} has no cluster_name: pass the YAML "
                                          "`rayfleet render` wrote (the one `ray up` launched)")
    return name


def target(path: str, err=None) -> Target:
    """The cluster of the YAML at ``path``, refused in one line without a token to use."""
    cfg, _ = clusteryaml.load(path)
    name = _cluster_name(cfg, path)
    default = Path(default_token_file(name)).expanduser().absolute()
    facts_file = clusteryaml.facts_path(path)
    if not facts_file.is_file() and not default.is_file():
        raise ClusterError(f"{path} has no {facts_file.name} beside it and there is no token "
                           f"at {default}: run `rayfleet render` for this cluster (it writes "
                           "both), then `ray up`")
    facts = clusteryaml.render_facts(path, err=err)
    token = Path(facts.token_file).expanduser().absolute() if facts and facts.token_file \
        else default
    if not token.is_file():
        raise ClusterError(f"the cluster's token {token} (render's facts name it) is missing: "
                           "run `rayfleet render` again, then `ray up` (the nodes take the "
                           "token from it)")
    remote = {DASHBOARD: port("dashboard"), SERVE: port("serve-http")}
    prom = metrics_port(cfg)
    if prom is not None:
        remote[METRICS] = prom
    return Target(cluster_yaml=Path(path).expanduser().absolute(), cluster=name,
                  folder=cluster_folder(name), token_file=token,
                  region=(facts.region if facts else None) or cfg["provider"].get("region"),
                  storage=facts.run_store if facts else None,
                  packages=runstore.packages(facts.storage_uri) if facts else None,
                  remote=remote)


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise ClusterError(f"cannot read the cluster's token {path} ({e.strerror})") from None
    if not token:
        raise ClusterError(f"the cluster's token {path} is empty: run `rayfleet render` again, "
                           "then `ray up`")
    return token


def _say(err, line: str) -> None:
    print(f"rayfleet: {line}", file=err, flush=True)


def _refused(tunnel: Tunnel, code: int | None, t: Target) -> ClusterError:
    return ClusterError(f"the head's dashboard (through {tunnel.url}) refused the cluster's "
                        f"token ({code}): {t.token_file} is not the token cluster {t.cluster} "
                        "was started with; use the token `rayfleet render` wrote for it")


def _reuse(t: Target, token: str, err) -> tuple[dict[str, Tunnel], tuple[Tunnel, int] | None]:
    """The recorded tunnels still running and answering, by role (one refusing the token
    too); every other one is stopped, where it is still this kit's to stop."""
    kept: dict[str, Tunnel] = {}
    refused = None
    dead: list[tuple[Tunnel, str]] = []
    for tun in tunnels.load(t.folder, err):
        wanted = t.remote.get(tun.role) == tun.remote_port and tun.role not in kept
        state, code = tunnels.answers(tun, token) if wanted and tun.ours() else (NOT_YET, None)
        if state == NOT_YET:
            dead.append((tun, "no longer answers" if wanted else "is not wanted"))
            continue
        kept[tun.role] = tun
        if state == REFUSED:
            refused = (tun, code)
        _say(err, f"{WHAT[tun.role]}: 127.0.0.1:{tun.local_port} -> the head's "
                  f"{tun.remote_port} (tunnel pid {tun.pid}, still open)")
    done = tunnels.stop(*(tun for tun, _ in dead))
    for (tun, why), did in zip(dead, done, strict=True):
        _say(err, f"the {tun.role} tunnel of 127.0.0.1:{tun.local_port} {why}: {did}")
    return kept, refused


def _wait(started: list, token: str, timeout: float, t: Target, err) -> None:
    """Until every tunnel just started answers; ClusterError (one line) when one exits first,
    refuses the token, or does not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = list(started)
    while pending:
        for tun, proc in list(pending):
            code = proc.poll()
            if code is not None:
                raise ClusterError(
                    f"`ray dashboard` for the head's port {tun.remote_port} exited ({code}) "
                    f"before its tunnel answered: {tunnels.last_said(tun.log, token)} -- is "
                    f"cluster {t.cluster} up? (`ray up {t.cluster_yaml}`; log: {tun.log})")
            state, status = tunnels.answers(tun, token)
            if state == REFUSED:
                raise _refused(tun, status, t)
            if state == OK:
                pending.remove((tun, proc))
                _say(err, f"{WHAT[tun.role]}: 127.0.0.1:{tun.local_port} -> the head's "
                          f"{tun.remote_port} (tunnel pid {tun.pid})")
        if pending and time.monotonic() > deadline:
            tun = pending[0][0]
            raise ClusterError(
                f"the tunnel to the head's port {tun.remote_port} (127.0.0.1:"
                f"{tun.local_port}) did not answer within {timeout:g} s: is cluster "
                f"{t.cluster} up and reachable over SSM? (log: {tun.log}; --timeout to wait "
                "longer)")
        if pending:
            time.sleep(0.1)


def open_tunnels(t: Target, token: str, timeout: float = WAIT_S, err=None) -> dict[str, Tunnel]:
    """The cluster's tunnels by role: those still open reused, the others started and waited
    for. On any failure the ones this call started are stopped, and the record keeps only the
    ones it found running."""
    err = err or sys.stderr
    with tunnels.locked(t.folder):
        kept, refused = _reuse(t, token, err)
        started: list = []
        try:
            if refused is not None:
                raise _refused(*refused, t)
            missing = [role for role in t.remote if role not in kept]
            try:
                ports = free_ports(len(missing)) if missing else []
            except OSError as e:
                raise ClusterError(f"no local ports for the tunnels: {e}") from None
            for role, local in zip(missing, ports, strict=True):
                started.append(tunnels.start(role, local, t.remote[role], t.cluster_yaml,
                                             t.folder))
            if started:
                _say(err, f"opening {len(started)} tunnel(s) to cluster {t.cluster}'s head "
                          f"(`ray dashboard` over SSM; up to {timeout:g} s)")
            _wait(started, token, timeout, t, err)
        except BaseException:
            tunnels.stop(*(tun for tun, _ in started))
            tunnels.save(t.folder, t.cluster_yaml, list(kept.values()))
            raise
        tunnels.save(t.folder, t.cluster_yaml,
                     list(kept.values()) + [tun for tun, _ in started])
    return {**kept, **{tun.role: tun for tun, _ in started}}


def client_env(t: Target, open_: dict[str, Tunnel]) -> dict[str, str]:
    """What a shell needs to use the cluster through its tunnels, as `rayfleet local env` gives
    it for a local one (localstate.LocalCluster.client_env)."""
    dashboard = open_[DASHBOARD].url
    env = {
        # The Jobs CLI reads RAY_ADDRESS (an http:// one: the Jobs API), or prefers
        # RAY_API_SERVER_ADDRESS; `serve deploy` reads RAY_DASHBOARD_ADDRESS.
        "RAY_ADDRESS": dashboard, "RAY_API_SERVER_ADDRESS": dashboard,
        "RAY_DASHBOARD_ADDRESS": dashboard,
        **auth_env(t.token_file),
        # Ray's clients (requests) send the token to a proxy unless told not to.
        "NO_PROXY": no_proxy_with(), "no_proxy": no_proxy_with(),
    }
    if t.storage:
        env[runstore.STORAGE_ENV] = t.storage
    if t.packages:
        env[runstore.PACKAGES_ENV] = t.packages
    if t.region:
        env["AWS_DEFAULT_REGION"] = t.region
    env[SERVE_URL_ENV] = open_[SERVE].url
    if METRICS in open_:
        env[METRICS_URL_ENV] = open_[METRICS].url
    return env


def env(path: str, shell: str = "sh", timeout: float = WAIT_S, out=None, err=None) -> int:
    """`rayfleet env CLUSTER_YAML`: the tunnels open, the exports on ``out`` (stdout), progress
    on ``err`` (stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    t = target(path, err)
    open_ = open_tunnels(t, _read_token(t.token_file), timeout, err)
    print("\n".join(export_lines(client_env(t, open_), shell)), file=out, flush=True)
    print(f"# Serve's apps: ${SERVE_URL_ENV} (the openai client: base_url=${SERVE_URL_ENV}/v1)."
          f" Close the tunnels: rayfleet env {shlex.quote(path)} --close", file=err, flush=True)
    return 0


def close(path: str, err=None) -> int:
    """`rayfleet env CLUSTER_YAML --close`: stop the tunnels recorded for the cluster, each only
    where its pid is still the process recorded (tunnels.stop), and forget them."""
    err = err or sys.stderr
    cfg, _ = clusteryaml.load(path)
    name = _cluster_name(cfg, path)
    folder = cluster_folder(name)
    recorded = []
    if folder.is_dir():
        with tunnels.locked(folder):
            recorded = tunnels.load(folder, err)
            for tun, did in zip(recorded, tunnels.stop(*recorded), strict=True):
                _say(err, f"the {tun.role} tunnel of 127.0.0.1:{tun.local_port}: {did}")
            tunnels.save(folder, Path(path).expanduser().absolute(), [])
    if not recorded:
        _say(err, f"no tunnels recorded for cluster {name} (nothing to stop)")
    return 0
