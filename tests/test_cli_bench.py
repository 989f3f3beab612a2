"""Checks `python -m real_py bench`: a real run on 2 self-launched gloo ranks (JSON fields,
verification) and its refusals.

A failure points to real_py/cli/bench.py (argument checks, the torch.distributed.run re-launch,
timing/JSON) or the `bench` entry in real_py/cli/bench.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from real_py.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 97,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.mark.dist
def test_bench_runs_and_writes_json(cfg, tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "real_py",
        "bench",
        "--model",
        str(cfg),
        "--dtype",
        "float32",
        "--src",
        "tp2",
        "--dst",
        "dp2",
        "--src",
        "dp2,dim0",
        "--dst",
        "dp2,flat",
        "--dst-ranks",
        "1,0",
        "--repeats",
        "1",
        "--link-gbps",
        "10",
        "--out",
        str(out),
        "--timeout",
        "60",
    ]
    tmp = tmp_path / "tmpdir"  # the job must leave nothing here (torchrun left torchelastic_*)
    tmp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "launching 2 local processes" in p.stdout
    assert os.listdir(tmp) == [], os.listdir(tmp)
    r = json.loads(out.read_text())
    m = r["machine"]
    assert m["world_size"] == 2 and m["backend"] == "gloo" and m["cpu_count"] == os.cpu_count()
    assert "gloo" in m["label"] and "cpu2" != m["label"]
    assert r["model"] == "config" and r["dtype"] == "float32" and r["repeats"] == 1
    assert [(x["src"], x["dst"]) for x in r["pairs"]] == [
        ("dp1tp2pp1", "dp2tp1pp1"),
        ("dp2tp1pp1-dim0", "dp2tp1pp1-flat"),
    ]
    assert r["pairs"][1]["dst_ranks"] == [1, 0]
    for x in r["pairs"]:
        assert x["verified"] is True
        assert x["seconds"] > 0 and len(x["seconds_all"]) == 1 and x["floor_seconds"] > 0
        assert x["network_bytes"] == x["min_network_bytes"] > 0
        for key in (
            "gbps_per_rank",
            "busiest_receiver_gbps",
            "pct_of_measured_peak",
            "pct_of_stated_peak",
        ):
            assert x[key] > 0, key
    # The printed table carries one line per pair.
    assert "dp2tp1pp1-dim0 -> dp2tp1pp1-flat" in p.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--src", "dp2,xp3", "--dst", "tp2"], "cannot parse layout"),
        (["--src", "tp2", "--dst", "tp3"], "pair 0 --dst dp1tp3pp1"),
        (["--src", "tp2", "--src", "dp2", "--dst", "tp2"], "2 --src but 1 --dst"),
        (["--src", "tp2", "--dst", "dp2", "--repeats", "0"], "--repeats=0 must be >= 1"),
    ],
)
def test_bench_refuses_bad_input(cfg, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", str(cfg)] + argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_unknown_model_and_existing_or_recorded_out(cfg, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--model", "llama9-1t", "--src", "tp2", "--dst", "dp2"])
    assert "--model 'llama9-1t' is neither a preset" in capsys.readouterr().err
    out = tmp_path / "r.json"
    out.write_text("keep me")
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(cfg), "--src", "tp2", "--dst", "dp2", "--out", str(out)])
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "keep me"
    recorded = REPO / "bench" / "results" / "mine.json"
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(cfg), "--src", "tp2", "--dst", "dp2", "--out", str(recorded)])
    assert "the project's recorded results" in capsys.readouterr().err
    assert not recorded.exists()
    # A link at --out (even with --overwrite, even dangling) is refused, its target untouched.
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    for target in (victim, tmp_path / "nowhere.json"):
        link = tmp_path / f"link_to_{target.name}"
        link.symlink_to(target)
        with pytest.raises(SystemExit):
            main(
                [
                    "bench",
                    "--model",
                    str(cfg),
                    "--src",
                    "tp2",
                    "--dst",
                    "dp2",
                    "--out",
                    str(link),
                    "--overwrite",
                ]
            )
        assert f"--out {link} is a symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere.json").exists()
    # The ranks write with O_NOFOLLOW too (a link planted after the launcher's check).
    from real_py.rlhf.observe import open_nofollow

    with pytest.raises(ValueError, match=f"{tmp_path / 'link_to_victim.json'} is a symbolic link"):
        open_nofollow(str(tmp_path / "link_to_victim.json"))
    assert victim.read_text() == "precious"
