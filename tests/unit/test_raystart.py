"""One `ray start` command line: rayfleet/raystart.py builds it for render and `rayfleet local
up`, and the Ansible role's launch script, a Jinja template that cannot call the kit, must
render the same flags in the same order for the same inputs."""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2
import pytest
import yaml

from rayfleet import raystart
from rayfleet.facts import HEAD_ONLY_PORTS, RAY_PORTS

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "infra" / "ansible" / "roles" / "ray_node"

# The role's variable for each port raystart pins (facts' RAY_PORTS names).
ROLE_PORT_VARS = {
    "gcs": "ray_node_gcs_port",
    "dashboard": "ray_node_dashboard_port",
    "client": "ray_node_client_server_port",
    "object-manager": "ray_node_object_manager_port",
    "node-manager": "ray_node_node_manager_port",
    "runtime-env-agent": "ray_node_runtime_env_agent_port",
    "metrics-export": "ray_node_metrics_export_port",
    "dashboard-agent-grpc": "ray_node_dashboard_agent_grpc_port",
    "dashboard-agent-http": "ray_node_dashboard_agent_listen_port",
    "worker-ports": ("ray_node_min_worker_port", "ray_node_max_worker_port"),
}


def _script(variables: dict) -> str:
    """The role's launch script as its template task writes it (Ansible's own filters; the
    template module's trim_blocks)."""
    from ansible.plugins.filter.core import FilterModule

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"),
                             trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update(FilterModule().filters())
    return env.get_template("ray-node-run.sh.j2").render(**variables)


def _ray_start(script: str) -> list[str]:
    """The script's `exec .../ray start ...` command, its continuation lines joined."""
    lines = script.splitlines()
    first = next(i for i, line in enumerate(lines)
                 if line.startswith("exec ") and "/bin/ray" in line)
    words = []
    for line in lines[first:]:
        words.append(line.removesuffix("\\"))
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(words))[1:]   # without `exec`


def _from_role(v: dict) -> list[str]:
    """raystart's command line for the node the role's variables describe."""
    head = v["ray_node_role"] == "head"
    ports = {name: tuple(v[x] for x in var) if isinstance(var, tuple) else v[var]
             for name, var in ROLE_PORT_VARS.items() if head or name not in HEAD_ONLY_PORTS}
    return raystart.argv(
        f"{v['ray_node_venv']}/bin/ray", head=head,
        address=None if head else v["ray_node_head_address"], ports=ports,
        dashboard_host=v["ray_node_dashboard_host"],
        node_ip_address=v["ray_node_node_ip_address"] or None, num_cpus=v["ray_node_num_cpus"],
        num_gpus=v["ray_node_num_gpus"], object_store_memory=v["ray_node_object_store_memory"],
        resources=v["ray_node_resources"] or None, temp_dir=v["ray_node_temp_dir"] or None,
        extra=v["ray_node_extra_args"], block=True, usage_stats=v["ray_node_usage_stats"],
        log_style="record")


NODES = {
    "head": {},
    "worker": {"ray_node_role": "worker", "ray_node_head_address": "10.0.0.10:6379"},
    "every-option": {"ray_node_num_cpus": 4, "ray_node_num_gpus": 0,
                     "ray_node_object_store_memory": 10**9,
                     "ray_node_resources": {"accelerator_type:A100": 1, "disk": 2.5},
                     "ray_node_temp_dir": "/tmp/ray node", "ray_node_node_ip_address": "",
                     "ray_node_extra_args": ["--include-log-monitor=false", "--labels={}"],
                     "ray_node_usage_stats": True, "ray_node_serve_ingress": "python"},
    # Every port moved, each to its own number: a variable on the wrong flag shows.
    "worker-own-ports": {"ray_node_role": "worker", "ray_node_head_address": "head:7000",
                         **{var: 20000 + i for i, var in enumerate(
                             v for var in ROLE_PORT_VARS.values()
                             for v in (var if isinstance(var, tuple) else (var,)))}},
}


@pytest.mark.parametrize("node", NODES)
def test_the_roles_ray_start_is_the_kits(node):
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    variables = {**defaults, "ansible_managed": "Ansible managed",
                 "_ray_node_manager": "systemd", "ray_node_node_ip_address": "10.0.0.11",
                 "ray_node_haproxy_dir": "/var/lib/ray-node/hap", **NODES[node]}
    assert _ray_start(_script(variables)) == _from_role(variables)


def test_the_role_names_a_variable_for_every_port_raystart_pins():
    assert set(ROLE_PORT_VARS) == set(raystart.pinned_ports(head=True))


def test_every_ray_port_pinned_at_facts_numbers_and_workers_leave_the_heads_out():
    head = raystart.argv("ray", head=True)
    worker = raystart.argv("ray", head=False, address="$RAY_HEAD_IP:6379")
    assert head[:4] == ["ray", "start", "--head", "--dashboard-host=127.0.0.1"]
    assert worker[:3] == ["ray", "start", "--address=$RAY_HEAD_IP:6379"]
    for p in RAY_PORTS:
        if not p.flag.startswith("--"):
            continue
        flags = [f"{f}={n}" for f, n in zip(p.flag.split("/"), (p.from_port, p.to_port),
                                            strict=False)]
        for flag in flags:
            assert flag in head
            assert (flag in worker) == (p.name not in HEAD_ONLY_PORTS), flag


def test_only_the_ports_named_are_pinned():
    cmd = raystart.argv("ray", head=True, block=True, usage_stats=False,
                        ports={"gcs": 7000, "metrics-export": 7001}, num_gpus=0)
    assert cmd == ["ray", "start", "--block", "--head", "--dashboard-host=127.0.0.1",
                   "--port=7000", "--metrics-export-port=7001", "--num-gpus=0",
                   "--disable-usage-stats"]


@pytest.mark.parametrize("kwargs", [
    {"head": True, "address": "h:6379"},                        # a head joins nothing
    {"head": False},                                            # a worker joins something
    {"head": False, "address": "h:6379", "ports": {"gcs": 1}},  # the head's own listener
    {"head": True, "ports": {"ssh": 22}},                       # no `ray start` flag
])
def test_impossible_nodes_are_refused(kwargs):
    with pytest.raises(ValueError):
        raystart.argv("ray", **kwargs)


def test_the_role_raises_the_open_files_limit_and_refuses_a_tiny_store_as_the_kit_does():
    templates = ROLE / "templates"
    assert f"\nulimit -n {raystart.NOFILE} " in (templates / "ray-node-run.sh.j2").read_text()
    assert f"\nLimitNOFILE={raystart.NOFILE}\n" in (templates / "ray-node.service.j2").read_text()
    validate = (ROLE / "tasks" / "validate.yml").read_text()
    assert f"ray_node_object_store_memory | int >= {raystart.MIN_OBJECT_STORE_BYTES} " in validate


def test_gcs_fault_tolerance_env_names_rays_variables_once():
    assert raystart.gcs_ft_env() == {
        "RAY_gcs_rpc_server_reconnect_timeout_s": str(raystart.GCS_RECONNECT_TIMEOUT_S)}
    head = raystart.gcs_ft_env("rediss://h:6380", ca_cert="/etc/ca.pem", namespace="c1")
    assert head == {"RAY_gcs_rpc_server_reconnect_timeout_s": str(raystart.GCS_RECONNECT_TIMEOUT_S),
                    "RAY_REDIS_ADDRESS": "rediss://h:6380", "RAY_REDIS_CA_CERT": "/etc/ca.pem",
                    "RAY_external_storage_namespace": "c1"}


def test_the_gcs_variables_are_ones_ray_2_60_reads():
    """Each name is in Ray's own code: node.py reads RAY_REDIS_ADDRESS, gcs_server the CA
    bundle, the namespace and the reconnect timeout."""
    import ray

    root = Path(ray.__file__).parent
    assert f'"{raystart.REDIS_ADDRESS_ENV}"' in (root / "_private" / "node.py").read_text()
    gcs_server = (root / "core" / "src" / "ray" / "gcs" / "gcs_server").read_bytes()
    for name in (raystart.REDIS_CA_CERT_ENV, raystart.EXTERNAL_STORAGE_NAMESPACE_ENV,
                 raystart.GCS_RECONNECT_TIMEOUT_ENV):
        assert name.encode() in gcs_server, name
