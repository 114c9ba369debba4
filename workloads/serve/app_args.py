"""The arguments of the kit's Serve apps, typed. Each app builder takes a pydantic model
(Serve validates the config's `args` into it before calling the builder); a wrong argument is
one line naming it, in `serve status` (a RayServeException, which Serve shows as it is) and
from `rayfleet serve-config` (a ConfigError, exit 2) alike.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from rayfleet.errors import ConfigError, RayfleetError
from workloads.common.runs import latest_finished_checkpoint
from workloads.common.storage import default_root, resolve

LATEST = "latest"


def _number(key: str, raw: Any, kind: type, minimum: float):
    """A numeric app argument, or one line naming it (not a ValueError in `serve deploy`)."""
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"args.{key}", f"must be a number, got {raw!r}") from None
    if not value >= minimum:   # also refuses NaN
        raise ConfigError(f"args.{key}", f"must be at least {minimum}, got {raw!r}")
    return value


class AppArgs(BaseModel):
    """Base of each app's arguments. Subclasses name the app and, for numbers, the minimum
    (`MINIMUM`); strings are taken as given (str() of what YAML made of them); an argument
    left empty takes its default."""

    model_config = ConfigDict(frozen=True)
    APP: ClassVar[str]
    MINIMUM: ClassVar[dict[str, float]] = {}

    @model_validator(mode="before")
    @classmethod
    def _one_line(cls, raw: Any) -> dict:
        # A ConfigError is not a ValueError: pydantic lets it through as it is, one line.
        raw = {k: v for k, v in dict(raw or {}).items() if v is not None and v != ""}
        unknown = sorted(set(raw) - set(cls.model_fields))
        if unknown:
            raise ConfigError(f"args.{unknown[0]}", f"unknown argument for the {cls.APP} app",
                              sorted(cls.model_fields), unknown[0])
        for key, value in raw.items():
            kind = cls.model_fields[key].annotation
            if kind in (int, float):
                raw[key] = _number(key, value, kind, cls.MINIMUM.get(key, 0))
            elif kind is str:
                raw[key] = str(value)
        return raw

    @classmethod
    def parse(cls, args: Any) -> AppArgs:
        """The arguments from a config's `args` mapping (or already parsed); ConfigError."""
        return args if isinstance(args, cls) else cls(**dict(args or {}))

    @classmethod
    def model_validate(cls, obj: Any, **kwargs) -> AppArgs:
        # What Serve calls on the config's args, before the builder and its builder_errors.
        from ray.serve.exceptions import RayServeException

        try:
            return super().model_validate(obj, **kwargs)
        except RayfleetError as e:
            raise RayServeException(f"{cls.APP} app: {e}") from None


def app_path(value: str, key: str) -> str:
    """An app argument naming a folder or s3:// prefix. Replicas run in Ray's own folders, not
    in the one `serve deploy` was typed in, so a relative path is refused in one line."""
    value = value.strip()
    if value.startswith("s3://") or value == LATEST:
        return value
    if not Path(value.removeprefix("file://")).expanduser().is_absolute():
        raise ConfigError(f"args.{key}", f"{value} is a relative path, and Serve replicas do not "
                                         "run in your folder: give an absolute path or "
                                         "s3://bucket/prefix")
    return str(Path(value.removeprefix("file://")).expanduser())


def resolve_checkpoint(value: str) -> str:
    """args.checkpoint, or `latest` (the default): the final checkpoint of the newest finished
    run under the cluster's default storage, where workloads.train writes without
    --storage-path ($RAYFLEET_STORAGE, else ~/rayfleet-runs)."""
    value = app_path(value, "checkpoint")
    if value != LATEST:
        return value
    root = default_root()
    try:
        found = latest_finished_checkpoint(resolve(root, check_writable=False, create=False))
    except RayfleetError:
        found = None
    if found is None:
        raise ConfigError("args.checkpoint", f"'latest': no finished workloads.train run under "
                                             f"{root} (the default storage); train one first or "
                                             "set args.checkpoint to a run's final checkpoint")
    return found


def builder_errors(app: str):
    """App builders raise one line: Serve shows a RayServeException's message as it is in
    `serve status`, where any other exception becomes a whole traceback."""
    from ray.serve.exceptions import RayServeException

    def wrap(fn):
        @functools.wraps(fn)
        def inner(args):
            try:
                return fn(args)
            except RayfleetError as e:
                raise RayServeException(f"{app} app: {e}") from None
        return inner
    return wrap
