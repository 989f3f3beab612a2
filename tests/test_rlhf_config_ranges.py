# Checks the allowed ranges of config values: every form of the range words (`> x`, `>= x`,
# `[a, b]`, `(a, b]`, `or null`, a note) tested at its bounds, a malformed one refused when
# declared, and a value out of range named with its dotted key and the words, section by section.
# A failure points to real_py/rlhf/config/ranges.py (ranged, _test, check_ranges) or the ranged
# fields of schema.py.
import dataclasses

import pytest

from real_py.rlhf import config as CF
from real_py.rlhf.config.ranges import _test, check_ranges


@pytest.mark.parametrize(
    "allowed, inside, outside",
    [
        ("> 0", [1e-9, 1, 5], [0, -1, None]),
        (">= 1", [1, 2], [0.999, 0, None]),
        (">= 0 (0: no checkpoints)", [0, 3], [-1]),
        ("[0, 1]", [0, 0.5, 1], [-0.01, 1.01]),
        ("(0, 1]", [1e-9, 1], [0, 1.5]),
        ("> 1 or null", [None, 1.5], [1, 0]),
        (">= 1 or null", [None, 1], [0.5]),
    ],
)
def test_range_words_are_the_rule(allowed, inside, outside):
    ok = _test(allowed)
    assert all(ok(v) for v in inside), allowed
    assert not any(ok(v) for v in outside), allowed


@pytest.mark.parametrize("allowed", ["positive", "< 3", "[0, 1", "0 .. 1"])
def test_malformed_range_words_are_refused_when_declared(allowed):
    with pytest.raises(ValueError, match="expected '> x', '>= x', '\\[a, b\\]' or '\\(a, b\\]'"):
        _test(allowed)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (None, "steps", 0, "config steps=0 is out of range; allowed: >= 1"),
        ("data", "batch_size", 0, "config data.batch_size=0 is out of range; allowed: >= 1"),
        (
            "generation",
            "top_p",
            1.5,
            "config generation.top_p=1.5 is out of range; allowed: (0, 1]",
        ),
        ("ppo", "dual_clip", 0.5, "config ppo.dual_clip=0.5 is out of range; allowed: > 1 or null"),
        (
            "reward",
            "overlong_buffer",
            -1,
            "config reward.overlong_buffer=-1 is out of range; "
            "allowed: >= 0 (0: no overlong penalty)",
        ),
        (
            "async_",
            "max_staleness",
            -1,
            "config async.max_staleness=-1 is out of range; allowed: >= 0 (0: synchronous)",
        ),
    ],
)
def test_out_of_range_value_is_named_with_its_key(section, key, value, message):
    cfg = CF.TrainConfig()
    check_ranges(cfg)
    if section is None:
        cfg = dataclasses.replace(cfg, **{key: value})
    else:
        cfg = dataclasses.replace(
            cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: value})}
        )
    with pytest.raises(ValueError) as e:
        check_ranges(cfg)
    assert str(e.value) == message
