"""What one `rayfleet render` was asked for: the one frozen object every fragment reads."""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.ingress import DEFAULT_INGRESS
from rayfleet.nodeenv import NodeEnv
from rayfleet.stack import StackOutputs


@dataclass(frozen=True)
class RenderOptions:
    """`rayfleet render`'s flags, and the node environment the nodes get."""

    token_file: str                      # the operator's Ray token, shipped to every node
    node_env: NodeEnv                    # the installed kit's (or a test's pyproject.toml)
    key_name: str | None = None          # --key-name; None: <cluster>-operator
    idle_timeout_minutes: int = 10       # --idle-timeout
    autostop_minutes: int | None = None  # --autostop-minutes; None: no auto-stop
    # --metrics: the head's Prometheus commands (rayfleet/commands/metrics.py, a level above
    # this one, so the command passes them in); empty: no Prometheus.
    prometheus: tuple[str, ...] = ()
    vllm: str = "cuda"                   # --vllm: cuda, cpu or none
    ingress: str = DEFAULT_INGRESS       # --ingress: Serve's ingress on every node

    def key(self, o: StackOutputs) -> str:
        """The EC2 key pair every node is launched with."""
        return self.key_name or f"{o.cluster_name}-operator"
