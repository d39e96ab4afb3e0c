"""Loading a recipe: a YAML file (`load_recipe`) or a mapping (`parse_recipe`) into the frozen dataclasses of
`specdeploy.recipe.config`, every key checked on the way (unknown keys, wrong types, missing required keys), then
`config_checks.check_recipe`. Every problem is a ConfigError that names the key."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from specdeploy.core.errors import ConfigError
from specdeploy.recipe.checks import check_recipe
from specdeploy.recipe.config import Recipe


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a YAML recipe; every problem is a ConfigError that names the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} not found", "pass a YAML file such as build/smollm2-135m.yaml")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"recipe {path} is not UTF-8 text (byte {exc.start}: {exc.reason})", "save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"recipe {path} cannot be read: {exc.strerror or exc}", "check the file's permissions"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path} is not valid YAML: {exc}", "fix the YAML syntax") from exc
    recipe = parse_recipe(raw, source=str(path))
    return recipe


def parse_recipe(raw, source: str = "recipe") -> Recipe:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys to values")
    recipe = _build(Recipe, raw, "")
    check_recipe(recipe)
    return recipe


def _build(cls, raw, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"key '{prefix.rstrip('.')}' must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields), key=str)  # YAML 1.1 reads some keys as booleans or numbers (on:, 1:)
    if unknown:
        boolean = (
            " (YAML 1.1 reads an unquoted on/off/yes/no key as true/false)" if isinstance(unknown[0], bool) else ""
        )
        raise ConfigError(
            f"unknown key '{prefix}{unknown[0]}'{boolean}",
            f"valid keys here: {', '.join(fields)}",
        )
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key '{key}'")
            continue
        kwargs[name] = _convert(hints[name], raw[name], key)
    return cls(**kwargs)


def _convert(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, key + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"key '{key}' must be a list, got {value!r}")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        # an unquoted version (1.10) reaches here as the float 1.1: say what YAML did with it, and how to keep the text
        quote = (
            f'; YAML read an unquoted number: quote the text you mean, e.g. {key.rsplit(".", 1)[-1]}: "{value}" '
            "(unquoted, 1.10 reads as 1.1)"
            if hint is str and isinstance(value, (int, float))
            else ""
        )
        raise ConfigError(f"key '{key}' must be {hint.__name__}, got {value!r} ({type(value).__name__}){quote}")
    return value
