"""Prometheus for a rayfleet cluster: the config (file-based service discovery on the file Ray's
head writes), the one `rayfleet local up --metrics` runs, and the head's commands for
`rayfleet render --metrics`.

Prometheus listens on 127.0.0.1 only, with its admin and lifecycle APIs off (their defaults):
what it serves is a read-only copy of what Ray's own metrics endpoints already serve. On AWS it
is reached through the dashboard's tunnel
(`ray dashboard --port PORT --remote-port PORT cluster.yaml`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from rayfleet.commands.host import alive, last_line, open_direct, port_in_use, state_dir
from rayfleet.errors import ClusterError
from rayfleet.facts import loopback_port

PROMETHEUS_PORT = loopback_port("prometheus")
# Ray's file-SD file (ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE; a unit test ties the
# two): the head's metrics agent rewrites it every 5 s with every live node's metrics
# endpoint, in the session folder, and keeps a symlink to it in the temp dir, the path that
# stays the same across sessions.
SD_FILE = "prom_metrics_service_discovery.json"
# Ray's temp dir on a cluster-launcher node (render passes no --temp-dir).
NODE_RAY_TEMP_DIR = "/tmp/ray"
# Half of Ray's 10 s metrics export interval, so every export is scraped; a finished
# process's gauges (the last loss of a run) stay exported for two intervals, so are always
# caught.
SCRAPE_INTERVAL_S = 5
# Prometheus watches the SD file's folder with inotify, but Ray replaces the symlink's target
# in the session folder, which that watch does not see: re-read it on a timer instead.
SD_REFRESH_S = 10
RETENTION = "15d"
READY_TIMEOUT_S = 30
# Where the head keeps Prometheus: the SSH user's home ($HOME, as `~` is not expanded after
# the `=` of a flag).
NODE_HOME_DIR = "$HOME/rayfleet-prometheus"


def config_text(sd_file: str | Path, loopback: bool = False,
                haproxy_port: int | None = None) -> str:
    """prometheus.yml: one job scraping every target in Ray's SD file. loopback: a one-machine
    cluster, whose targets are scraped on 127.0.0.1. haproxy_port: also scrape the exporter of
    this machine's HAProxy (Serve's ingress, rayfleet.ingress), which the guard keeps on
    loopback; HAProxies on other nodes report through Ray's own serve_haproxy_* metrics."""
    job = {"job_name": "ray",
           "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": f"{SD_REFRESH_S}s"}]}
    if loopback:
        # Ray names a local node by the machine's own address (services.resolve_ip_for_
        # localhost) but its metrics endpoints listen on every interface: scraping them on
        # loopback keeps the local Prometheus's traffic on this machine.
        job["relabel_configs"] = [{"source_labels": ["__address__"], "regex": r".+:(\d+)",
                                   "target_label": "__address__", "replacement": "127.0.0.1:$1"}]
    # JSON is YAML: no YAML library needed on the head, and the file path is quoted safely.
    return json.dumps({
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                   "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [job] + ([{
            "job_name": "haproxy",
            "static_configs": [{"targets": [f"127.0.0.1:{haproxy_port}"]}]}]
            if haproxy_port else []),
    }, indent=2) + "\n"


def prometheus_args(binary: str, config: str, data: str, port: int) -> list[str]:
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--storage.tsdb.retention.time={RETENTION}",
            f"--web.listen-address=127.0.0.1:{port}"]


def kit_dashboard() -> Path:
    """The kit's Grafana dashboard (package data)."""
    return Path(str(resources.files("rayfleet") / "dashboards" / "rayfleet.json"))


def ray_dashboards_dir(ray_temp_dir: str | Path) -> Path:
    """Where Ray's head writes its generated Grafana dashboards (metrics_head.py)."""
    return Path(ray_temp_dir) / "session_latest" / "metrics" / "grafana" / "dashboards"


# ----------------------------------------------------------------------------- AWS head

def head_commands(port: int = PROMETHEUS_PORT, haproxy: bool = True) -> list[str]:
    """Commands for the head's head_start_ray_commands, after `ray start`: install Debian's
    prometheus when missing, write its config, (re)start it on 127.0.0.1:port in the
    background. Idempotent: `ray up` runs them again on every update."""
    home = NODE_HOME_DIR
    config = base64.b64encode(config_text(
        f"{NODE_RAY_TEMP_DIR}/{SD_FILE}",
        haproxy_port=loopback_port("haproxy-metrics") if haproxy else None).encode()).decode()
    apt = ("sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 -q -y")
    return [
        # The package's own service would listen on every interface: masked before the
        # install, so only ours runs (and only on loopback). No node exporter (a Recommends).
        "command -v prometheus >/dev/null || { if [ -d /run/systemd/system ]; then "
        "sudo systemctl mask prometheus.service; fi && "
        f"{apt} update && {apt} install --no-install-recommends prometheus; }}",
        f"mkdir -p {home}/data && echo {config} | base64 -d > {home}/prometheus.yml",
        # A previous run's Prometheus (this is a re-run of `ray up`) lets go of the port and
        # the data folder's lock first.
        f"if [ -f {home}/pid ]; then kill $(cat {home}/pid) 2>/dev/null; for _ in $(seq 50); "
        f"do kill -0 $(cat {home}/pid) 2>/dev/null || break; sleep 0.2; done; fi",
        # nohup and every fd redirected: Ray's SSH command runner returns at once.
        "nohup " + " ".join(prometheus_args("prometheus", f"{home}/prometheus.yml",
                                             f"{home}/data", port))
        + f" > {home}/prometheus.log 2>&1 < /dev/null & echo $! > {home}/pid",
    ]


# ----------------------------------------------------------------------------- local

@dataclass
class LocalPrometheus:
    pid: int
    port: int
    config: str
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _dir() -> Path:

    return state_dir() / "prometheus"


def _state_file() -> Path:
    return _dir() / "prometheus.json"


def load_local() -> LocalPrometheus | None:
    """The running local Prometheus, if any (a stale state file is removed)."""

    try:
        prom = LocalPrometheus(**json.loads(_state_file().read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    if alive(prom.pid) and _is_ours(prom):
        return prom
    _state_file().unlink(missing_ok=True)
    return None


def _is_ours(prom: LocalPrometheus) -> bool:
    # A pid the kernel has since given to another process is not ours to signal.
    try:
        return prom.config in Path(f"/proc/{prom.pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def check_port(port: int, flag: str = "--prometheus-port") -> None:

    if port_in_use(port):
        raise ClusterError(f"port {port} (Prometheus) is already in use by another process; "
                           f"stop it or pick another with {flag}")


def ensure_binary(out=sys.stdout) -> str:
    """The prometheus binary: on PATH, else Debian's package installed with apt-get."""
    found = shutil.which("prometheus")
    if found:
        return found
    if not shutil.which("apt-get"):
        raise ClusterError("prometheus is not installed and this machine has no apt-get; "
                           "put a prometheus binary on PATH")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        raise ClusterError("prometheus is not installed; install it as root: "
                           "apt-get install --no-install-recommends prometheus")
    print("prometheus is not installed: installing Debian's package "
          "(apt-get install prometheus)", file=out, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if Path("/run/systemd/system").is_dir():
        # The package's service would start a second Prometheus on every interface.
        subprocess.run([*sudo, "systemctl", "mask", "prometheus.service"], env=env,
                       capture_output=True)
    install = [*sudo, "apt-get", "-q", "-y", "install", "--no-install-recommends", "prometheus"]
    proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        # Most often a package index that is missing or stale: refresh it once.
        subprocess.run([*sudo, "apt-get", "-q", "update"], env=env, capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
    found = shutil.which("prometheus")
    if proc.returncode != 0 or not found:
        why = (proc.stderr.strip().splitlines() or ["prometheus not on PATH afterwards"])[-1]
        raise ClusterError(f"could not install prometheus with apt-get: {why}")
    return found


def start_local(ray_temp_dir: Path, port: int, binary: str,
                haproxy_port: int | None = None) -> LocalPrometheus:
    """Start Prometheus on 127.0.0.1:port scraping the local cluster; wait until it is ready."""
    folder = _dir()
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(config_text(Path(ray_temp_dir) / SD_FILE, loopback=True,
                                  haproxy_port=haproxy_port))
    log = folder / "prometheus.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen(prometheus_args(binary, str(config), str(folder / "data"), port),
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    prom = LocalPrometheus(pid=proc.pid, port=port, config=str(config), log=str(log))
    tmp = _state_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(prom), indent=2))
    tmp.replace(_state_file())
    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:

            _state_file().unlink(missing_ok=True)
            raise ClusterError(f"prometheus exited with code {proc.returncode}: "
                               f"{last_line(log)} (full log: {log})")
        if ready(prom.url):
            return prom
        time.sleep(0.3)
    stop_local()
    raise ClusterError(f"prometheus did not answer within {READY_TIMEOUT_S}s; see {log}")


def ready(url: str) -> bool:
    try:
        with open_direct(f"{url}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_local(timeout: float = 10.0) -> LocalPrometheus | None:
    """Stop the local Prometheus `start_local` started, and only it."""
    prom = load_local()
    if prom is None:
        return None
    try:
        os.kill(prom.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass

    end = time.time() + timeout
    while time.time() < end and alive(prom.pid):
        time.sleep(0.2)
    if alive(prom.pid):
        try:
            os.kill(prom.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _state_file().unlink(missing_ok=True)
    return prom


def info_lines(prom: LocalPrometheus, ray_temp_dir: Path) -> list[str]:
    return [f"  prometheus: {prom.url}  (loopback only; scrapes {Path(ray_temp_dir) / SD_FILE})",
            f"  dashboards: {kit_dashboard()}  (the kit's)",
            f"              {ray_dashboards_dir(ray_temp_dir)}/  (Ray's)"]
