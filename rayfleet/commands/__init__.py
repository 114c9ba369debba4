"""The operator's commands (`rayfleet ...`), above the kit's core.

The core (``rayfleet.errors``, ``entrypoint``, ``facts``, ``rules``, ``catalog``, ``config``,
``stack``, ``ingress``, ``nodeenv``) and the node agents (``rayfleet.agents``) are what the
workloads, ``infra/`` and the nodes import; nothing below this package imports it
(tests/unit/test_imports.py holds the edges).
"""
