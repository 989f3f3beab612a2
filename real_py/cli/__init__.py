"""Command line: `python -m real_py <command> ...`.

Each command lives in its own module exposing `add_parser(subparsers)` and `run(args) -> int`;
add a command with one line in COMMANDS. A ValueError or OSError from a command (bad input, a
missing or unwritable file) prints one line `error: ...` and exits with status 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "plan": "real_py.cli.plan",
    "search": "real_py.cli.search",
    "train": "real_py.cli.train",
    "export": "real_py.cli.export",
    "plot": "real_py.cli.plot",
    "bench": "real_py.cli.bench",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m real_py", description="Parameter reallocation for RLHF (ReaL-style)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, mod in COMMANDS.items():
        modules[name] = importlib.import_module(mod)
        modules[name].add_parser(sub)
    # KEY=VALUE overrides may stand anywhere on a `train` line (`train a=1 --steps 3 b=2`):
    # argparse stops a positional list at the first option, so the rest comes back as extras.
    args, extra = parser.parse_known_args(argv)
    bad = [x for x in extra if x.startswith("-") or not hasattr(args, "overrides")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return modules[args.command].run(args)
    except (ValueError, OSError) as e:
        parser.exit(2, f"error: {e}\n")
