"""YAML mappings into frozen section dataclasses: unknown keys and wrongly typed values are
errors that name the key (deploy.config's sections use it)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from deploy.security import ConfigError


def build(cls: type, data: Any, sections: dict[str, type], prefix: str = "") -> Any:
    """A section dataclass from a mapping: unknown keys and wrongly typed values are errors that
    name the key. `sections`: the section dataclasses by type name (a field of one of those
    types is built from a nested mapping)."""
    where = prefix.rstrip(".") or "the config"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]!s} (known in {where}: "
                          f"{', '.join(known)})")
    values = {}
    for name, value in data.items():
        kind = known[name].type
        section = sections.get(kind)
        values[name] = (build(section, value, sections, f"{prefix}{name}.") if section
                        else _typed(f"{prefix}{name}", value, kind))
    return cls(**values)


def _typed(key: str, value: Any, kind: str) -> Any:
    if value is None and "None" in kind:
        return None
    if kind.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if "float" in kind and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if "int" in kind and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "str" in kind and isinstance(value, str):
        return value
    raise ConfigError(f"{key} must be {kind.replace(' | None', ' or null')}, got {value!r}")
