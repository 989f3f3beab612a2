"""Allowed ranges of config values: schema.py declares each beside its field with
`ranged(default, allowed)`, and `check_ranges(cfg)` refuses the first value outside its range.

`allowed` is the rule in the words the error shows: "> x", ">= x", "[a, b]" or "(a, b]" (either
bracket), optionally followed by " or null" (None is allowed) and a note in parentheses, e.g.
">= 0 (0: no checkpoints)". The words are parsed into the test, so the message always says
what is checked.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable
from typing import Any

_COMPARE = {">": operator.gt, ">=": operator.ge}


def ranged(default: Any, allowed: str) -> Any:
    """A dataclass field with `default` whose value must lie in `allowed`."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "ok": _test(allowed)})


def _test(allowed: str) -> Callable[[Any], bool]:
    note = allowed.find(" (")
    rule = allowed if note < 0 else allowed[:note]
    null = rule.endswith(" or null")
    rule = rule.removesuffix(" or null")
    if m := re.fullmatch(r"(>=?) (\S+)", rule):
        compare, bound = _COMPARE[m[1]], float(m[2])
        inside = lambda v: compare(v, bound)
    elif m := re.fullmatch(r"([\[(])(\S+), (\S+)([\])])", rule):
        lo, hi = float(m[2]), float(m[3])
        above = operator.ge if m[1] == "[" else operator.gt
        below = operator.le if m[4] == "]" else operator.lt
        inside = lambda v: above(v, lo) and below(v, hi)
    else:
        raise ValueError(
            f"range {allowed!r}: expected '> x', '>= x', '[a, b]' or '(a, b]', "
            "optionally with ' or null' and a note in parentheses"
        )
    return lambda v: null if v is None else inside(v)


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """ValueError naming the first field of `cfg` (sections in turn) whose value is out of range;
    types are already checked."""
    for f in dataclasses.fields(cfg):
        v, key = getattr(cfg, f.name), prefix + f.name
        if "ok" in f.metadata and not f.metadata["ok"](v):
            raise ValueError(
                f"config {key.replace('async_', 'async')}={v!r} is out of range; allowed: "
                f"{f.metadata['allowed']}"
            )
        if dataclasses.is_dataclass(v):
            check_ranges(v, key + ".")
