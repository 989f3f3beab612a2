"""Hardware profiles by name, measured ones included: `resolve_profile` turns `cpu` into this
machine's profile, calibrated on first use (measure.calibrate_cpu) and cached in $REAL_PY_CACHE or
~/.cache/real_py; the datasheet GPU names go to real_py.search.hardware.get_profile.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict

from ..search.hardware import MEASURED, PROFILE_NAMES, HardwareProfile, get_profile
from .measure import calibrate_cpu
from .setup import DEFAULT, Setup


def _cache_path() -> str:
    base = os.environ.get("REAL_PY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "real_py"
    )
    return os.path.join(base, "cpu_profile.json")


def resolve_profile(name: str) -> HardwareProfile:
    """A profile by name (one of PROFILE_NAMES): `cpu` is calibrated on first use and cached (see
    cpu_profile); the datasheet GPU profiles are real_py.search.hardware.get_profile's."""
    key = name.lower().replace("-80g", "").replace("-", "")
    if key in MEASURED:
        return cpu_profile()
    try:
        return get_profile(name)
    except ValueError:
        raise ValueError(
            f"unknown hardware profile {name!r}; allowed: {', '.join(PROFILE_NAMES)}"
        ) from None


CACHE_VERSION = 12
"""Bumped when calibrate_cpu measures something new: older cache files are recalibrated."""


def cpu_profile(
    refresh: bool = False, reps: int = 25, repeats: int = 3, setup: Setup = DEFAULT
) -> HardwareProfile:
    """The calibrated `cpu` profile of this machine (real_py.calibrate.measure), cached in
    $REAL_PY_CACHE or ~/.cache/real_py; `refresh` measures again (`reps` runs per figure, each
    field the median of `repeats` calibrations). `setup`: the calibration engines (default: the
    small calibration model; `Setup.for_job` profiles a job's own model shape and pass sizes);
    a cache file of another setup is recalibrated."""
    path = _cache_path()
    if not refresh and os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if (
            data.get("machine") == platform.node()
            and data.get("version") == CACHE_VERSION
            and data.get("setup") == asdict(setup)
        ):
            return HardwareProfile(**data["profile"])
    prof, raw = calibrate_cpu(reps, repeats, setup)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "machine": platform.node(),
                "version": CACHE_VERSION,
                "setup": asdict(setup),
                "measured": raw,
                "profile": asdict(prof),
            },
            f,
            indent=1,
        )
    return prof
