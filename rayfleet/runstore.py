"""The run store: one per cluster, ``<storage_uri>runs`` (inside the prefix the node roles may
read and write), where a run named N keeps its checkpoints and its logs (``runs/N/``). Render
names it to every node in the environment below; the workloads read it back from there."""

from __future__ import annotations

# The run store's root, on every node of a rendered cluster (workloads.common.storage's
# default_root), and the one prefix the node roles may touch (infra/components/iam.py).
STORAGE_ENV = "RAYFLEET_STORAGE"
PREFIX_ENV = "RAYFLEET_STORAGE_PREFIX"
# The folder under the stack's storage the log shipper writes (rayfleet/agents/logship.py).
RUNS = "runs"
# Where `rayfleet serve-config --package-to` puts Serve apps' code on a cloud cluster (inside
# the prefix, so every node's role may read it); `rayfleet env` exports it.
PACKAGES_ENV = "RAYFLEET_PACKAGES"
PACKAGES = "packages"


def root(storage_uri: str) -> str:
    """The run store under the stack's storage: ``s3://B/P/`` -> ``s3://B/P/runs``."""
    return f"{storage_uri.rstrip('/')}/{RUNS}"


def packages(storage_uri: str) -> str:
    """Serve apps' code packages under the stack's storage: ``s3://B/P/packages``."""
    return f"{storage_uri.rstrip('/')}/{PACKAGES}"


def inside(uri: str, prefix: str) -> bool:
    """Whether the s3:// ``uri`` is the s3:// ``prefix`` or under it, on a folder boundary."""
    base = prefix.rstrip("/")
    if base.count("/") < 2:   # "s3://" alone names no bucket
        return False
    return uri.rstrip("/") == base or uri.startswith(base + "/")
