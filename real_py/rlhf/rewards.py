"""Reward functions written by the user, and the samples file of a run.

    reward: {kind: function, path: "reward.py:copy_last"}   # beside the config file;
                                                            # or "pkg.module:fn"

    fn(prompts: list[str], responses: list[str], **row) -> list[float]

`prompts` are the data set's prompt values (decoded prompt tokens for the built-in synthetic
prompts), `responses` the decoded responses (special tokens such as EOS skipped), `row` the data
set's other fields, each a list with one value per row (e.g. answer=["4", "7", ...]). The function
is loaded, checked for being callable, its parameters checked against the data's fields
(`check_signature`: "the data has no field 'solution'") and, with a data set, called once on its
first row (an empty response) in `config.validate`, before any rank starts; a result of the wrong
length or type raises ValueError naming the function.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os

import torch

from .observe import open_nofollow


def load_function(spec: str):
    """ "file.py:fn" (a path; a relative one in a config file was joined to the file's folder by
    config.read_yaml, one given on the command line is relative to the working directory) or
    "package.module:fn"."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(
            f"config reward.path={spec!r}: expected 'path/to/file.py:function' or "
            "'package.module:function'"
        )
    where, name = spec.split(":")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(
                f"config reward.path={spec!r}: no such file {where!r} (relative to {os.getcwd()})"
            )
        mod_name = "real_py_reward_" + os.path.splitext(os.path.basename(where))[0]
        ms = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(ms)
        try:
            ms.loader.exec_module(module)
        except Exception as e:
            raise ValueError(
                f"config reward.path={spec!r}: importing {where} failed: {type(e).__name__}: {e}"
            ) from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise ValueError(
                f"config reward.path={spec!r}: cannot import module {where!r}: "
                f"{type(e).__name__}: {e}"
            ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"config reward.path={spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(
            f"config reward.path={spec!r}: {name} is a {type(fn).__name__}, not callable"
        )
    return fn


class FunctionReward:
    """A loaded user reward function: __call__ returns scores [b] float32."""

    def __init__(self, spec: str):
        self.spec, self.fn = spec, load_function(spec)

    def __call__(self, prompts: list, responses: list[str], row: dict[str, list]) -> torch.Tensor:
        return self.check(self.fn(prompts, responses, **row), len(responses))

    def check(self, out, n: int) -> torch.Tensor:
        """`out` of the function as [n] float32 scores, or ValueError naming the function."""
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        try:
            if isinstance(out, (str, bytes)):
                raise TypeError("a string is not a list of scores")
            items = list(out)
            vals = [float(x) for x in items]
        except (TypeError, ValueError):
            raise ValueError(
                f"reward function {self.spec} returned {type(out).__name__} "
                f"{str(out)[:80]}; expected a list of {n} floats"
            ) from None
        text = next((x for x in items if isinstance(x, (str, bytes))), None)
        if text is not None:  # "0.5" passes float(): a score must be a number, not its text
            raise ValueError(
                f"reward function {self.spec} returned the string {text!r} as a score; "
                f"expected a list of {n} floats (numbers, not strings)"
            )
        if len(vals) != n:
            raise ValueError(
                f"reward function {self.spec} returned {len(vals)} scores for "
                f"{n} responses; expected one float per response"
            )
        bad = [v for v in vals if not math.isfinite(v)]
        if bad:
            raise ValueError(f"reward function {self.spec} returned a non-finite score {bad[0]}")
        return torch.tensor(vals, dtype=torch.float32)


def check_signature(fr: FunctionReward, fields: list[str], where: str) -> None:
    """The function's parameters against the data's fields, before any call: two positional
    parameters (prompts, responses), every other parameter without a default a field of the data,
    and every field a parameter unless it takes **row. `where` names the data in messages."""
    import inspect

    try:
        sig = inspect.signature(fr.fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: the call checks it
    ps = list(sig.parameters.values())
    P = inspect.Parameter
    positional = [p for p in ps if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    star_args = any(p.kind == P.VAR_POSITIONAL for p in ps)
    call = "fn(prompts, responses, **row)"
    if len(positional) < 2 and not star_args:
        raise ValueError(
            f"reward function {fr.spec} takes {len(positional)} positional parameter(s) "
            f"({', '.join(p.name for p in positional) or 'none'}); it is called as {call}: give it "
            "two, e.g. def fn(prompts, responses, **row)"
        )
    rest = positional[2:] + [p for p in ps if p.kind == P.KEYWORD_ONLY]
    missing = [p.name for p in rest if p.default is P.empty and p.name not in fields]
    if missing:
        have = f"the fields {sorted(fields)}" if fields else "no fields besides the prompt"
        raise ValueError(
            f"reward function {fr.spec}: the data has no field "
            f"{', '.join(repr(m) for m in missing)} "
            f"(a parameter of the function without a default; the data, {where}, has {have}); "
            "add the field to every row, give "
            f"the parameter a default (e.g. {missing[0]}=None), or rename it to a field"
        )
    if not any(p.kind == P.VAR_KEYWORD for p in ps):
        extra = sorted(set(fields) - {p.name for p in rest})
        if extra:
            raise ValueError(
                f"reward function {fr.spec} is called with every field of the data as a keyword "
                f"({call}) but has no parameter for {extra} ({where}); add **row to its "
                "parameters (or a parameter per field)"
            )


def check_call(fr: FunctionReward, data) -> None:
    """Call the function once on the data set's first two rows (one if it has one) with empty
    responses, so a function that fails, or returns a fixed number of scores instead of one per
    response, shows before any rank starts; the result checks of FunctionReward apply as well."""
    idx = list(range(min(2, len(data))))
    prompts, row = data.prompt_values(idx), data.fields(idx)
    try:
        out = fr.fn(prompts, [""] * len(idx), **row)
    except Exception as e:
        raise ValueError(
            f"reward function {fr.spec} failed when called as fn(prompts, responses, "
            f"**row) with row fields {sorted(row)} of the data set's first {len(idx)} row(s) and "
            f"empty responses: {type(e).__name__}: {e}"
        ) from None
    fr.check(out, len(idx))


def write_samples(
    path: str, step: int, prompts: list, responses: list, scores: torch.Tensor, rows: list[int]
) -> None:
    """Append one JSON line per sample: step (1-based, as metrics.jsonl), batch row, prompt,
    response, reward."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open_nofollow(path, append=True) as f:
        for r, p, s, v in zip(rows, prompts, responses, scores.tolist()):
            f.write(
                json.dumps(
                    {"step": step + 1, "row": r, "prompt": p, "response": s, "reward": v},
                    default=str,
                )
                + "\n"
            )


__all__ = ["load_function", "FunctionReward", "check_signature", "check_call", "write_samples"]
