"""Reading a train config: YAML (1.2 booleans), KEY=VALUE overrides, and typed construction.

Relative input paths written in a config file resolve against the file's folder (paths.py).

Every section rejects unknown keys (ValueError naming the section, the key and the allowed
keys). Values are checked against the field annotations (`_coerce`: numeric strings become
numbers, inf and nan are refused, anything else of the wrong type is refused naming the dotted key),
then against the allowed ranges (ranges.py) and the other checks of one config (checks.py).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from ...spec import ModelConfig
from .checks import check_values
from .paths import resolve_paths
from .schema import TrainConfig


def _describe(tp) -> str:
    """An annotation in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    return {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        dict: "a mapping",
        list: "a list",
        type(None): "null",
    }.get(origin or tp, str(tp))


def _coerce(value, tp, key: str):
    """`value` as the annotation `tp` wants it, or ValueError naming the dotted `key`.

    Numbers given as strings are converted (PyYAML reads `1e-5` as a string): "8" -> 8 for an
    int, "1e-5" -> 1e-05 for a float; 2.0 is an int, 2.5 is not. Booleans are only true/false
    (the YAML loader below does not read yes/no/on/off as booleans, so those are refused here).
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return _coerce(value, a, key)
                except ValueError:
                    pass
    elif origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ValueError(f"config {key}={value!r}; allowed: {', '.join(repr(a) for a in args)}")
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp in (int, float) and not isinstance(value, bool):
        x = value
        if isinstance(x, str):
            try:
                x = int(x.strip()) if tp is int else float(x)
            except ValueError:
                try:
                    x = float(x)
                except ValueError:
                    pass
        if isinstance(x, float) and not math.isfinite(x):
            # 1e400 and .inf read as inf: a run would exit 0 with NaN losses.
            raise ValueError(f"config {key}={value!r}: expected a finite number, got {x}")
        if isinstance(x, (int, float)):
            if tp is float:
                return float(x)
            if isinstance(x, int) or x.is_integer():
                return int(x)
    elif tp in (str, dict, list) or origin in (dict, list):
        if isinstance(value, origin or tp):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value
    raise ValueError(f"config {key}={value!r}: expected {_describe(tp)}")


def _build(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise ValueError(f"config {where}: expected a mapping, got {type(d).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"config {where}: unknown keys {unknown}; allowed: {allowed}")
    hints = typing.get_type_hints(cls)
    prefix = "" if cls is TrainConfig else where + "."
    kw = {}
    for k, v in d.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kw[k] = _build(tp, v, prefix + k)
        else:
            kw[k] = _coerce(v, tp, prefix + k)
    return cls(**kw)


def from_dict(d: dict | None) -> TrainConfig:
    # `async` is a Python keyword: the section's field is async_.
    d = {("async_" if k == "async" else k): v for k, v in (d or {}).items()}
    cfg = _build(TrainConfig, d, "top level")
    model_hints = typing.get_type_hints(ModelConfig)
    for name in ("actor", "critic"):
        md = getattr(cfg, name)
        if md:
            # Known ModelConfig fields get the same typing as the sections; unknown ones are
            # refused by model_configs() with the list of fields.
            setattr(
                cfg,
                name,
                {
                    k: _coerce(v, model_hints[k], f"{name}.{k}") if k in model_hints else v
                    for k, v in md.items()
                },
            )
    check_values(cfg)
    return cfg


def _yaml_loader():
    """PyYAML's SafeLoader with YAML 1.2 booleans: only true/false (any case) are booleans, so
    `greedy: yes` stays the string 'yes' and is refused instead of silently meaning true."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"),
    )
    return Loader


def read_yaml(path: str | None) -> dict:
    """The mapping of a YAML config file ({} for None), its relative input paths (INPUT_PATHS)
    joined to the file's folder; ValueError naming the file otherwise."""
    if path is None:
        return {}
    import yaml

    try:
        with open(path) as f:
            d = yaml.load(f, Loader=_yaml_loader())
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(
            f"config file {path} is not valid YAML: {' '.join(str(e).split())}"
        ) from None
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"config file {path}: expected a mapping of keys, got {type(d).__name__}")
    d = d or {}
    resolve_paths(d, path)
    return d


def apply_overrides(d: dict, overrides) -> dict:
    """A copy of `d` with `key.sub=value` strings applied (values read as YAML, like the file).

    `plan.path=x.json` replaces the whole plan mapping (a plan file stands for the plan). Unknown
    keys are left in for `_build` to refuse like unknown YAML keys.
    """
    import copy

    import yaml

    from .schema import default_plan

    d = copy.deepcopy(d)
    # The algorithm decides the default plan that plan.* overrides edit (an algo= override too).
    algo = next(
        (
            i.partition("=")[2].strip()
            for i in reversed(list(overrides))
            if i.partition("=")[0].strip() == "algo"
        ),
        d.get("algo", "ppo"),
    )
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(
                f"override {item!r}: expected KEY=VALUE with a dotted KEY, e.g. ppo.actor_lr=1e-5"
            )
        try:
            value = yaml.load(text, Loader=_yaml_loader()) if text.strip() else None
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: the value is not valid YAML") from None
        if parts == ["plan", "path"]:
            d["plan"] = {}
        elif len(parts) > 1 and parts[0] not in d:
            # plan.calls.ref_inf.tp=2 without a plan in the file edits the default plan.
            f = next((f for f in dataclasses.fields(TrainConfig) if f.name == parts[0]), None)
            if parts[0] == "plan":
                try:
                    d["plan"] = default_plan(algo)
                except ValueError:
                    pass  # an unknown algo is refused by check_values
            elif f is not None and f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
                if isinstance(default, dict):
                    d[parts[0]] = copy.deepcopy(default)
        node = d
        for i, p in enumerate(parts[:-1]):
            if not isinstance(node.get(p), dict):
                if node.get(p) is not None:
                    raise ValueError(
                        f"override {item!r}: {'.'.join(parts[: i + 1])} is not a mapping"
                    )
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return d


def load(path: str | None, overrides=()) -> TrainConfig:
    """The config of a YAML file (None: the embedded default) with KEY=VALUE overrides applied."""
    return from_dict(apply_overrides(read_yaml(path), overrides))


def to_dict(cfg: TrainConfig) -> dict:
    return {("async" if k == "async_" else k): v for k, v in dataclasses.asdict(cfg).items()}
