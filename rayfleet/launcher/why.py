"""A mapping whose values may carry the sentence that goes above their key, written as YAML
with those comments (docs/house.md, convention 3), or as the plain mapping Ray loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Why:
    """A value with the sentence that goes above its key (docs/house.md, convention 3)."""

    value: Any
    why: str


def emit(mapping: dict[str, Any], indent: int = 0) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for key, value in mapping.items():
        if isinstance(value, Why):
            lines.append("")
            for part in _wrap(value.why, 96 - indent):
                lines.append(f"{pad}# {part}")
            value = value.value
        k = yaml.safe_dump(key, default_style=None).strip().removesuffix("\n...").strip()
        if isinstance(value, dict) and value and any(isinstance(v, (Why, dict))
                                                     for v in value.values()):
            lines.append(f"{pad}{k}:")
            lines.extend(emit(value, indent + 2))
        elif isinstance(value, (dict, list)) and value:
            dumped = yaml.safe_dump(value, default_flow_style=False, sort_keys=False,
                                    width=4096).rstrip("\n")
            lines.append(f"{pad}{k}:")
            lines.extend(f"{pad}  {ln}" for ln in dumped.splitlines())
        else:
            dumped = yaml.safe_dump(value, default_flow_style=True, width=4096).strip()
            dumped = dumped.removesuffix("...").strip()
            lines.append(f"{pad}{k}: {dumped}")
    return lines


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return out + ([line] if line else [])


def plain(value: Any) -> Any:
    """The mapping without comments, as Ray would load it."""
    if isinstance(value, Why):
        return plain(value.value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
