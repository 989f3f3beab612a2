"""Measured hardware profiles: the `cpu` profile of this machine and GPU profiles with measured
launch costs, timed on the runtime's own engines and transports (see README.md).
`resolve_profile(name)` is the one place a profile name becomes a profile by calibrating."""

from .fit import profile_from_raw
from .measure import calibrate_cpu, calibrate_gpu
from .profiles import cpu_profile, resolve_profile
from .setup import DEFAULT, Setup

__all__ = [
    "resolve_profile",
    "cpu_profile",
    "calibrate_cpu",
    "calibrate_gpu",
    "profile_from_raw",
    "Setup",
    "DEFAULT",
]
