"""Node agents: standalone programs that `rayfleet render` ships to every cluster node as
~/rayfleet-agents/ and starts from the node's start commands.

A node has only the node environment (pyproject's dependencies: ray, torch, boto3, ...), not
the kit's code, so each agent runs as `python <folder>/<name>.py ARGS` using the standard
library and that environment alone: it imports nothing from `rayfleet`, `workloads` or a
sibling file. The kit may import an agent (e.g. for a key it publishes); never the reverse.
"""
