"""The Pulumi program: load the stack config, build the components, export the outputs.

Everything else lives in infra/components (resources) and rayfleet/config.py (validation).
"""

import sys
from pathlib import Path

# Pulumi runs this file by path with only infra/ on sys.path; `make setup` installs rayfleet
# into .venv (editable), and this covers a venv made without it.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import pulumi

from infra.components import build
from rayfleet.config import load_stack_config
from rayfleet.errors import RayfleetError

try:
    outputs = build(load_stack_config(pulumi.Config()))
except RayfleetError as err:
    # One line under `pulumi up`, no traceback (as every rayfleet error); RunError is Pulumi's
    # clean-exit error.
    raise pulumi.RunError(str(err)) from None

for name, value in outputs.items():
    pulumi.export(name, value)
