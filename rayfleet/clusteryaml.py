"""The one reader of a Ray cluster YAML (what `rayfleet render` writes, and the head's copy at
``facts.BOOTSTRAP_CONFIG``): the file loaded in one line or refused in one, its node types
typed, and :func:`at_once`, what a cluster can run at the same time."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rayfleet.errors import RayfleetError
from rayfleet.facts import BOOTSTRAP_CONFIG

__all__ = ["BOOTSTRAP_CONFIG", "ClusterYaml", "NodeType", "Unloadable", "at_once",
           "bucket_from_header", "load", "read"]

# Why a file is not a cluster YAML (Unloadable.kind).
MISSING, UNREADABLE, NOT_TEXT, NOT_YAML, SHAPE = ("missing", "unreadable", "not text",
                                                  "not YAML", "shape")

T = TypeVar("T")


class Unloadable(RayfleetError):
    """A cluster YAML that cannot be loaded, said as `rayfleet lint` says it; ``kind`` and
    ``strerror`` (the OS's reason) let a reader that words it its own way do so."""

    def __init__(self, message: str, kind: str, strerror: str | None = None):
        super().__init__(message)
        self.kind, self.strerror = kind, strerror


def read(path: str, expand: bool = False) -> tuple[Any, str]:
    """(the parsed YAML, its text); ``expand``: ``~`` is the home folder."""
    file = Path(path).expanduser() if expand else Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise Unloadable(f"{path}: no such file", MISSING, e.strerror) from None
    except OSError as e:
        raise Unloadable(f"{path}: cannot read ({e.strerror})", UNREADABLE, e.strerror) from None
    except UnicodeDecodeError as e:
        raise Unloadable(f"{path}: not UTF-8 text (byte {e.start}); is this a cluster YAML?",
                         NOT_TEXT) from None
    try:
        return yaml.safe_load(text), text
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise Unloadable(f"{path}: not valid YAML{at}", NOT_YAML) from None


def load(path: str) -> tuple[dict, str]:
    """(the config, its text) of a cluster YAML whose shape every check may walk."""
    cfg, text = read(path)
    if not isinstance(cfg, dict) or "provider" not in cfg:
        raise Unloadable(f"{path}: not a Ray cluster YAML (no provider: section)", SHAPE)
    # Anything else is a typo that would otherwise surface as an AttributeError deep inside
    # a check.
    if not isinstance(cfg["provider"], dict):
        raise Unloadable(f"{path}: provider: must be a mapping (type:, region:, ...), got "
                         f"{type(cfg['provider']).__name__}", SHAPE)
    types = cfg.get("available_node_types")
    if types is not None and not isinstance(types, dict):
        raise Unloadable(f"{path}: available_node_types: must be a mapping of node type "
                         "names to their settings", SHAPE)
    for name, nt in (types or {}).items():
        if not isinstance(nt, dict) or not isinstance(nt.get("node_config", {}), dict) \
                or not isinstance(nt.get("resources", {}), dict):
            raise Unloadable(f"{path}: available_node_types.{name}: must be a mapping with "
                             "node_config: and resources: mappings", SHAPE)
        for key in ("min_workers", "max_workers"):
            if key in nt and (isinstance(nt[key], bool) or not isinstance(nt[key], int)
                              or nt[key] < 0):
                raise Unloadable(f"{path}: available_node_types.{name}.{key}: must be a "
                                 f"whole number >= 0, got {nt[key]!r}", SHAPE)
    return cfg, text


def bucket_from_header(text: str) -> str | None:
    """The jobs' storage `rayfleet render` names in the YAML's header."""
    m = re.search(r"^# Storage for jobs: (s3://\S+)", text, re.M)
    return m.group(1) if m else None


def at_once(limits: list[tuple[T, int]], cap: int | None) -> list[tuple[T, int]]:
    """How many of each item run at the same time, in the order given: each up to its own
    limit, all of them together up to ``cap`` (no cap beyond their sum where None)."""
    left = sum(n for _, n in limits) if cap is None else int(cap)
    out = []
    for item, n in limits:
        take = max(0, min(left, n))
        out.append((item, take))
        left -= take
    return out


@dataclass(frozen=True)
class NodeType:
    """One entry of ``available_node_types``, as the YAML gives it."""

    name: str
    spec: Mapping[str, Any]
    head: bool

    @property
    def resources(self) -> dict[str, Any]:
        return dict(self.spec.get("resources") or {})

    def numbers(self) -> dict[str, float]:
        """The declared resources that are numbers, as floats (what Ray schedules by)."""
        return {k: float(v) for k, v in self.resources.items() if isinstance(v, (int, float))}

    @property
    def node_config(self) -> dict[str, Any]:
        return dict(self.spec.get("node_config") or {})

    @property
    def min_workers(self) -> int:
        return int(self.spec.get("min_workers", 0))

    @property
    def max_workers(self) -> int | None:
        """As declared; None where the YAML leaves it out."""
        value = self.spec.get("max_workers")
        return None if value is None else int(value)

    @property
    def market(self) -> str | None:
        """The node config's MarketType (spot, capacity-block); None: on-demand."""
        return (self.node_config.get("InstanceMarketOptions") or {}).get("MarketType")


_YAMLS = object()   # ClusterYaml.capacity's cap: the YAML's own max_workers


@dataclass(frozen=True)
class ClusterYaml:
    """Typed access to a loaded cluster YAML (``cfg``, a mapping)."""

    cfg: Mapping[str, Any]

    @property
    def head_type(self) -> str | None:
        return self.cfg.get("head_node_type")

    @property
    def max_workers(self) -> int | None:
        """The cluster's max_workers, every worker type together; None where left out."""
        value = self.cfg.get("max_workers")
        return None if value is None else int(value)

    def node_types(self) -> list[NodeType]:
        """Every node type, the head's too, in the YAML's order (the scorer's preference)."""
        return [NodeType(name, nt or {}, name == self.head_type)
                for name, nt in (self.cfg.get("available_node_types") or {}).items()]

    def head(self) -> NodeType | None:
        return next((t for t in self.node_types() if t.head), None)

    def workers(self) -> list[NodeType]:
        return [t for t in self.node_types() if not t.head]

    def capacity(self, key: Callable[[NodeType], Any] | None = None, cap: Any = _YAMLS,
                 head: bool = False) -> list[tuple[NodeType, int]]:
        """(node type, how many of its nodes) the cluster can have at once: :func:`at_once`
        over the worker types, each up to its max_workers (none where it has none), together
        up to ``cap`` (the YAML's max_workers by default), those ``key`` sorts first taking
        their share first (the YAML's order without one); with ``head``, the head's one node
        first."""
        workers = self.workers()
        if key is not None:
            workers = sorted(workers, key=key)
        out = at_once([(t, t.max_workers or 0) for t in workers],
                      self.max_workers if cap is _YAMLS else cap)
        first = self.head() if head else None
        return ([(first, 1)] if first else []) + out
