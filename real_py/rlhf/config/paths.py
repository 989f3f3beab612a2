"""Relative paths of a train config.

Relative input paths (INPUT_PATHS: checkpoints, data, tokenizer, reward file, plan file) written in
a config file resolve against the file's folder, as most trainers' config loaders do, so a config
runs from any directory; KEY=VALUE overrides (and configs built in Python) resolve against the
working directory. `out_dir` is an output and stays relative to the working directory (a config
run from two directories writes two runs, never one into the config's folder). `path_origin`
says, for a message about a missing path, which base it was resolved against.
"""

from __future__ import annotations

import os

INPUT_PATHS = (
    "actor_path",
    "critic_path",
    "reward_path",
    "ref_path",
    "data.path",
    "data.tokenizer_path",
    "reward.path",
    "plan.path",
)
"""Dotted keys whose values are input files or directories (reward.path: only its "file.py"
part)."""

_WRITTEN: dict = {}
"""(dotted key, resolved value) -> (value as written, config file): for path_origin."""


def resolve_paths(d: dict, file: str) -> None:
    """Join the relative INPUT_PATHS values of `d`, read from `file`, to the file's folder."""
    base = os.path.dirname(file)
    for key in INPUT_PATHS:
        *sections, leaf = key.split(".")
        node = d
        for s in sections:
            node = node.get(s) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(leaf), str) or not node[leaf]:
            continue
        v = node[leaf]
        if key == "reward.path":
            where, sep, fn = v.rpartition(":")
            if not sep or not where.endswith(".py") or os.path.isabs(where):
                continue  # package.module:fn, or an absolute file
            new = os.path.normpath(os.path.join(base, where)) + ":" + fn
        elif os.path.isabs(v):
            continue
        else:
            new = os.path.normpath(os.path.join(base, v))
        node[leaf] = new
        _WRITTEN[(key, new)] = (v, file)


def path_origin(key: str, value: str) -> str:
    """How `value` of the dotted `key` was resolved, in words, for a message about a missing
    path."""
    w = _WRITTEN.get((key, value))
    if w is not None:
        return (
            f"written {w[0]!r} in {w[1]}: relative paths in a config file resolve against the "
            f"file's folder, {os.path.abspath(os.path.dirname(w[1]))}"
        )
    if os.path.isabs(value.rpartition(":")[0] if key == "reward.path" and ":" in value else value):
        return "an absolute path"
    return (
        f"resolved against the working directory {os.getcwd()}: paths given as KEY=VALUE on the "
        "command line (or without a config file) resolve there"
    )
