"""What a workload needs on its node, checked before it starts (not found out after training).

The node environment is pyproject.toml's dependencies (and its deepspeed extra); a node built
some other way may lack part of it. Each workload names the modules it will import, and a
missing one is one line and exit 2 — not a traceback from a worker, or after the last step.
"""

from __future__ import annotations

import importlib.util

from rayfleet.errors import RayfleetError


class MissingDependency(RayfleetError):
    pass


def require(modules: dict[str, str], needed_for: str) -> None:
    """modules: import name -> the pip distribution that provides it."""
    lacking = []
    for module, dist in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            lacking.append(dist)
    if lacking:
        raise MissingDependency(
            f"this node's Python lacks {', '.join(lacking)} (needed for {needed_for}); every "
            "node needs the node environment, pyproject.toml's dependencies and deepspeed "
            "extra (the cluster YAML's setup commands and the Ansible role install it)")
