"""Argument parsing shared by the `python -m real_py` commands: model names and rank lists."""

from __future__ import annotations

import json
import os

from ..spec import PRESETS, ModelConfig, preset


def model_config(text: str, flag: str, **overrides) -> ModelConfig:
    """A preset name or a path to an HF config.json / checkpoint directory; ValueError listing
    the presets when it is neither."""
    if text in PRESETS:
        return preset(text, **overrides)
    if not os.path.exists(text):
        raise ValueError(
            f"{flag} {text!r} is neither a preset ({', '.join(PRESETS)}) nor an existing "
            "HF config.json or checkpoint directory"
        )
    try:
        return ModelConfig.from_hf(text, **overrides)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{flag} {text!r}: not a readable HF config ({type(e).__name__}: {e})"
        ) from None


def ranks(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'0,1,2' -> (0, 1, 2); None -> None."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"{flag} {text!r}: expected comma-separated non-negative integers, e.g. 0,1,2,3"
        ) from None
