"""The one reader of a Ray cluster YAML (what `rayfleet render` writes, and the head's copy at
``facts.BOOTSTRAP_CONFIG``): the file loaded in one line or refused in one, its node types
typed, :func:`at_once`, what a cluster can run at the same time, and render's facts, read from
the file render writes beside the YAML (:func:`render_facts`)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import yaml

from rayfleet import runstore
from rayfleet.errors import RayfleetError
from rayfleet.facts import BOOTSTRAP_CONFIG

__all__ = ["BOOTSTRAP_CONFIG", "ClusterYaml", "FACTS_SCHEMA", "FACTS_SUFFIX", "NodeType",
           "RenderFacts", "Unloadable", "at_once", "autoscaler_config", "bucket_from_header",
           "facts_path", "load", "read", "render_facts"]

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


def autoscaler_config(path: str = BOOTSTRAP_CONFIG) -> dict:
    """The head's autoscaling config ({} on a cluster that does not autoscale, and off one)."""
    try:
        cfg, _ = read(path, expand=True)
    except Unloadable:
        return {}
    return cfg if isinstance(cfg, dict) else {}


# render's facts, beside the YAML it writes (<stem>.rayfleet.json); a reader refuses a newer
# schema than its own.
FACTS_SUFFIX = ".rayfleet.json"
FACTS_SCHEMA = 1


@dataclass(frozen=True)
class RenderFacts:
    """What `rayfleet render` knew when it wrote a cluster YAML. Read from an older YAML's
    header comment (``legacy``), only ``storage_uri`` and ``run_store`` are known."""

    storage_uri: str
    run_store: str
    stack: str | None = None
    cluster_name: str | None = None
    region: str | None = None
    token_file: str | None = None
    schema_version: int = FACTS_SCHEMA
    legacy: bool = dataclasses.field(default=False, compare=False)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if k != "legacy"},
                          indent=2, sort_keys=True) + "\n"


def facts_path(path: str | Path) -> Path:
    """The facts file of the cluster YAML at ``path``: ``x.yaml`` -> ``x.rayfleet.json``."""
    path = Path(path)
    return path.with_name(path.stem + FACTS_SUFFIX)


def _parse_facts(file: Path) -> RenderFacts:
    fix = "re-render the cluster YAML with `rayfleet render`"
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise RayfleetError(f"{file}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError):
        raise RayfleetError(f"{file}: not JSON; {fix}") from None
    if not isinstance(data, dict):
        raise RayfleetError(f"{file}: not a JSON object; {fix}")
    version = data.get("schema_version")
    if type(version) is not int or version < 1:
        raise RayfleetError(f"{file}: schema_version {version!r} is not a version; {fix}")
    if version > FACTS_SCHEMA:
        raise RayfleetError(f"{file}: schema_version {version} is newer than this kit's "
                            f"{FACTS_SCHEMA}; upgrade rayfleet, or re-render with this one")
    keys = [f.name for f in dataclasses.fields(RenderFacts)
            if f.name not in ("schema_version", "legacy")]
    bad = [k for k in keys if not isinstance(data.get(k), str) or not data[k]]
    if bad:
        raise RayfleetError(f"{file}: {', '.join(bad)} missing or not text; {fix}")
    return RenderFacts(schema_version=version, **{k: data[k] for k in keys})


def render_facts(path: str, err: TextIO | None = None) -> RenderFacts | None:
    """render's facts for the cluster YAML at ``path`` (loaded, or refused in one line): its
    facts file, refused in one line when malformed or another cluster's; without one (a
    hand-written YAML, or an older kit's), the storage of its header comment, said on ``err``
    (stderr) in one line, for one release; None where neither is there."""
    cfg, text = load(path)
    file = facts_path(path)
    if file.is_file():
        facts = _parse_facts(file)
        if facts.cluster_name != cfg.get("cluster_name"):
            raise RayfleetError(f"{file}: is cluster {facts.cluster_name!r}'s, and {path} is "
                                f"{cfg.get('cluster_name')!r}'s; re-render the cluster YAML "
                                "with `rayfleet render`")
        return facts
    uri = bucket_from_header(text)
    if uri is None:
        return None
    print(f"rayfleet: {path} has no {file.name} beside it (hand-written, or rendered by an "
          "older kit): read its '# Storage for jobs:' comment, which stops working after this "
          "release; re-render it with `rayfleet render`", file=err or sys.stderr)
    return RenderFacts(storage_uri=uri, run_store=runstore.root(uri), legacy=True)


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

    def spans_cloud_nodes(self) -> bool:
        """Whether this is a cloud cluster that can have more than one node (an AWS provider
        and a worker type that may launch): a folder on one of its nodes is not a place the
        others, or the operator after `ray down`, can read."""
        return (self.cfg.get("provider") or {}).get("type") == "aws" and any(
            (t.max_workers or 0) > 0 for t in self.workers())

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
