"""Typed configuration from YAML: the machinery every stage's config dataclass is built with.

A stage owns one frozen dataclass for its section (`services.indexer.config.IndexerConfig`, ...) whose
`__post_init__` checks every field with the helpers below. `build` turns a YAML mapping into such a
dataclass (nested sections, optional sections, lists and mappings included): unknown keys, wrong types and
bad values are `ConfigError`s that name the key (`indexer.link_rule`), the value and what is allowed, raised
when the file is loaded, before anything starts. `load_tree` reads a file plus `section.key=value`
overrides (values parsed as YAML). A field a resumed run may change says so where it is declared (`resumable`),
and `resumable_keys` collects them for a whole config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A setting that cannot be used: the message names the key, the value and what is allowed."""


class FieldError(ConfigError):
    """Raised by a config dataclass's checks; `build` prefixes the field with its section."""

    def __init__(self, name: str, value: Any, requirement: str):
        self.name, self.value, self.requirement = name, value, requirement
        super().__init__(f"{name} must be {requirement}, got {value!r}")

    def within(self, prefix: str) -> ConfigError:
        key = f"{prefix}.{self.name}" if prefix else self.name
        return ConfigError(f"{key} must be {self.requirement}, got {self.value!r}")


# --- checks a config dataclass runs on its own fields ------------------------------------------------


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not value > 0:
            raise FieldError(name, value, "> 0")


def at_least(obj: Any, name: str, minimum: float) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or value < minimum:
        raise FieldError(name, value, f">= {minimum}")


def within(obj: Any, name: str, low: float, high: float, high_open: bool = False) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not (low <= value < high if high_open else low <= value <= high):
        raise FieldError(name, value, f"in [{low}, {high}{')' if high_open else ']'}")


def one_of(obj: Any, name: str, legal: Iterable[Any]) -> None:
    value, legal = getattr(obj, name), list(legal)
    if value not in legal:
        raise FieldError(name, value, f"one of {legal}")


def non_negative_mapping(obj: Any, name: str) -> None:
    for key, value in getattr(obj, name).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise FieldError(f"{name}.{key}", value, "a number >= 0")


# --- what a resumed run may change ------------------------------------------------------------------

RESUMABLE = "resumable"
"""The field metadata key `resumable` sets: True, "comparable", or (on a section) the names of its keys."""


def resumable(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
              comparable: bool = False, keys: tuple[str, ...] = ()) -> Any:
    """A config field a resumed run may change: how long the run goes on, how it reports, where it runs and on
    what, never what it trains (the data, the model, the objectives, the schedule, the batches). On a section, every
    key of it, or only `keys` (for a section whose dataclass does not mark its own fields). `comparable`: changing
    it leaves what the run measures comparable with what it measured before (it extends the run or paces its
    progress lines), the narrower set a resumed experiment keeps its curves under. `resumable_keys` collects them."""
    mark: Any = keys or ("comparable" if comparable else True)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={RESUMABLE: mark})


def section_type(typ: Any) -> type | None:
    """The config dataclass a field's annotated type holds (`X`, `X | None`), or None for a plain value."""
    return next((t for t in (typ, *get_args(typ)) if isinstance(t, type) and dataclasses.is_dataclass(t)), None)


def resumable_keys(cls: type, prefix: str = "", comparable: bool = False) -> tuple[str, ...]:
    """The dotted keys of config dataclass `cls` (and the sections in it) that a resumed run may change, read
    from the fields' `resumable` marks: a key as 'section.key', a whole section as 'section.'. `comparable`: only
    those marked comparable."""
    hints = get_type_hints(cls)
    out: list[str] = []
    for f in fields(cls):
        key, mark, section = f"{prefix}{f.name}", f.metadata.get(RESUMABLE), section_type(hints[f.name])
        if mark is True or mark == "comparable":
            if mark == "comparable" or not comparable:
                out.append(f"{key}." if section is not None else key)
            continue
        if isinstance(mark, tuple) and not comparable:
            out += [f"{key}.{name}" for name in mark]
        if section is not None:
            out += [k for k in resumable_keys(section, f"{key}.", comparable) if k not in out]
    return tuple(out)


def may_change_on_resume(key: str, keys: Iterable[str]) -> bool:
    """Whether dotted `key` is one of `keys` (`resumable_keys`) or lies in a section they name whole."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in keys)


# --- building dataclasses from YAML -----------------------------------------------------------------


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check a YAML value against a field's annotated type (ints accepted for floats)."""
    origin, args = get_origin(typ), get_args(typ)
    if origin is Union or type(None) in args:  # Optional[X] (X | None)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key} may not be null")
        inner = [a for a in args if a is not type(None)]
        for typ_ in inner[:-1]:  # a union such as int | str: the first type the value is
            try:
                return _coerce(key, value, typ_)
            except ConfigError:
                pass
        try:
            return _coerce(key, value, inner[-1])
        except ConfigError:
            if len(inner) == 1:
                raise
            names = " or ".join(getattr(t, "__name__", str(t)) for t in inner)
            raise ConfigError(f"{key} must be a {names}, got {value!r}") from None
    if value is None:
        raise ConfigError(f"{key} may not be null")
    if isinstance(typ, type) and dataclasses.is_dataclass(typ):
        return build(typ, value, key)
    if typ is Any:
        return value
    if origin is None and typ in (int, float, str, bool):
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if typ is float and isinstance(value, str):
            try:  # PyYAML (YAML 1.1) reads 2e-3 as a string; accept what float() accepts
                return float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if typ is int and isinstance(value, bool) or not isinstance(value, typ):
            raise ConfigError(f"{key} must be a {typ.__name__}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str) and origin is list:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        items = [_coerce(f"{key}[{i}]", v, args[0] if args else Any) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {k: _coerce(f"{key}.{k}", v, args[1] if args else Any) for k, v in value.items()}
    return value


def unknown_keys_message(prefix: str, unknown: list[str], known: set[str]) -> str:
    """`<section.key> is not a key of ...; did you mean ...?`: the dotted key first, so that an error from a
    command-line override is blamed on that override, with the nearest known keys."""
    import difflib

    where = f"section {prefix!r}" if prefix else "the top level"
    dotted = [f"{prefix}.{k}" if prefix else k for k in unknown]
    near = [m for k in unknown for m in difflib.get_close_matches(k, sorted(known), n=2, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(repr(m) for m in dict.fromkeys(near))}?" if near else "."
    return f"{', '.join(dotted)}: unknown key(s) {unknown} in {where}{hint} Known keys: {sorted(known)}"


def build(cls: type, values: Any, prefix: str = "") -> Any:
    """`cls` from a YAML mapping: every key known, every value of the right type, the class's checks run."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'the config'} must be a mapping, got {values!r}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(unknown_keys_message(prefix, unknown, known))
    kwargs = {name: _coerce(f"{prefix}.{name}" if prefix else name, value, hints[name]) for name, value in values.items()}
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise e.within(prefix) from None


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: Iterable[str],
                    form: str = "section.key=value (e.g. run.max_steps=200)") -> list[tuple[str, Any]]:
    """'section.key=value' strings, the value parsed as YAML (numbers, booleans, lists, mappings); `form` is what an
    error says an override must look like (`marge info --set` takes model fields: key=value)."""
    out = []
    for text in overrides:
        if "=" not in text:
            raise ConfigError(f"override {text!r} must look like {form}")
        key, raw = text.split("=", 1)
        try:
            out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else None))
        except yaml.YAMLError as e:
            raise ConfigError(f"override {text!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return out


def load_tree(path: str | Path | None, overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The YAML mapping of `path` (empty when None) with the overrides applied."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found from {Path.cwd()}: a relative --config is read from the "
                              "current folder, and the shipped configs (deploy/configs/) name their data relative to "
                              "the repository's root: run marge from there, or give --config an absolute path")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
    for key, value in parse_overrides(overrides):
        set_dotted(tree, key, value)
    return tree
