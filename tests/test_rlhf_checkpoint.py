# Checks checkpoint safety and integrity: round trip (shards, Adam moments, RNG), pickle-free
# loading (a pickled callable is refused and never runs), sha256 per file (flipped byte, truncated
# shard, non-JSON meta.json name the file), and temp files that never follow a planted symlink.
# A failure points to real_py/rlhf/checkpoint.py (save / check / load / find).
"""In-process: a 1-rank gloo world (file rendezvous) and a stand-in runtime holding one trained
engine (flat buffer, Adam moments, step count) are enough for save(); the real kill/resume path
runs in tests/test_rlhf_runtime.py::test_kill_and_resume."""

import hashlib
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from real_py.rlhf import checkpoint
from real_py.rlhf import config as CF


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    init = tmp_path_factory.mktemp("pg") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _runtime(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat, m, v = (torch.randn(1000, generator=g) for _ in range(3))
    tr = SimpleNamespace(exp_avg=m, exp_avg_sq=v.abs(), num_steps=3, master=None)
    eng = SimpleNamespace(
        optim=object(), shard=SimpleNamespace(flat=flat), layout="dp1tp2pp2", _trainer=tr
    )
    return SimpleNamespace(cfg=cfg, models=SimpleNamespace(engines={"actor": eng, "ref": None}))


def _snapshot(d):
    return {p: open(os.path.join(d, p), "rb").read() for p in sorted(os.listdir(d))}


@pytest.fixture()
def saved(world, tmp_path):
    cfg = CF.from_dict({})
    out = str(tmp_path / "run")
    os.makedirs(out)
    rt = _runtime(cfg)
    torch.manual_seed(77)
    path = checkpoint.save(rt, out, 1)
    return cfg, out, path, rt


def test_round_trip_restores_shards_moments_rng(saved):
    cfg, out, path, rt = saved
    eng = rt.models.engines["actor"]
    want = [eng.shard.flat.clone(), eng._trainer.exp_avg.clone(), eng._trainer.exp_avg_sq.clone()]
    rng = torch.get_rng_state()
    assert checkpoint.find("", out) == path and checkpoint.check(cfg, path) == 1
    assert checkpoint.find(out, "elsewhere") == path == checkpoint.find(path, "elsewhere")
    for bad, phrase in (
        (os.path.join(out, "step_7"), "does not exist"),
        (os.path.dirname(out), "has no meta.json"),
    ):
        with pytest.raises(ValueError, match=f"--resume {bad}: no checkpoint: {phrase}"):
            checkpoint.find(bad, out)  # out/latest is fine, but X was asked for
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert set(meta["files"]) == {"rank0.pt"} and len(meta["files"]["rank0.pt"]["sha256"]) == 64
    for t in (eng.shard.flat, eng._trainer.exp_avg, eng._trainer.exp_avg_sq):
        t.zero_()
    eng._trainer.num_steps = 0
    torch.manual_seed(5)
    assert checkpoint.load(rt, path) == 1
    for a, b in zip(want, [eng.shard.flat, eng._trainer.exp_avg, eng._trainer.exp_avg_sq]):
        assert torch.equal(a, b)
    assert eng._trainer.num_steps == 3 and torch.equal(torch.get_rng_state(), rng)
    assert sorted(os.listdir(out)) == ["latest", "step_1"]
    assert sorted(os.listdir(path)) == ["meta.json", "rank0.pt"]  # no temp files left


def _flip_tensor_byte(p):
    """Flip one byte inside the stored flat tensor's data (torch.save zip: data/<n> records)."""
    data = bytearray(open(p, "rb").read())
    marker = torch.load(p, weights_only=True)["models"]["actor"]["flat"][:4].numpy().tobytes()
    i = bytes(data).find(marker)
    assert i > 0
    data[i + 1] ^= 0x40
    open(p, "wb").write(bytes(data))


def _truncate(p):
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])


def _garbage_meta(p):
    open(p, "w").write("{not json")


CORRUPT = [  # (file, damage, phrase)
    ("rank0.pt", _flip_tensor_byte, "rank0.pt fails its sha256 check"),
    ("rank0.pt", _truncate, r"rank0.pt has \d+ bytes, meta.json says \d+: truncated"),
    ("meta.json", _garbage_meta, "meta.json is not valid JSON"),
    ("rank0.pt", os.remove, "rank0.pt is missing"),
]


@pytest.mark.parametrize("name,damage,phrase", CORRUPT, ids=[c[1].__name__ for c in CORRUPT])
def test_corrupt_files_are_named_on_resume(saved, name, damage, phrase):
    cfg, out, path, rt = saved
    damage(os.path.join(path, name))
    before = _snapshot(path)
    flat = rt.models.engines["actor"].shard.flat.clone()
    with pytest.raises(ValueError, match=phrase):
        checkpoint.check(cfg, path)
    with pytest.raises(ValueError, match=phrase):
        checkpoint.load(rt, path)
    assert _snapshot(path) == before  # nothing rewritten
    assert torch.equal(rt.models.engines["actor"].shard.flat, flat)  # nothing restored


class _Plant:
    """Pickles as a call to os.makedirs(marker): runs only if the loader executes pickled code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_pickled_callable_is_refused_and_never_runs(saved, tmp_path):
    cfg, out, path, rt = saved
    marker = str(tmp_path / "code_ran")
    good = torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    rank_file = os.path.join(path, "rank0.pt")
    torch.save(good | {"hook": _Plant(marker)}, rank_file)
    # The attacker rewrites meta.json too, so the checksum matches: weights_only must stop it.
    meta = json.load(open(os.path.join(path, "meta.json")))
    data = open(rank_file, "rb").read()
    meta["files"]["rank0.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    assert checkpoint.check(cfg, path, verify_files=False) == 1
    # The launcher's check reads every rank file's content too, and each rank its own file.
    for refuse in (lambda: checkpoint.check(cfg, path), lambda: checkpoint.load(rt, path)):
        with pytest.raises(
            ValueError, match=r"rank0.pt refused: it holds more than tensors.*weights_only"
        ):
            refuse()
    assert not os.path.exists(marker)
    torch.load(rank_file, weights_only=False)  # the payload is real: an unsafe load runs it
    assert os.path.isdir(marker)


def test_planted_symlinks_are_not_written_through(saved, tmp_path):
    cfg, out, path, rt = saved
    victims = {
        n: tmp_path / f"victim_{n}" for n in ("latest.tmp", "latest", "rank0.pt", "meta.json")
    }
    for v in victims.values():
        v.write_text("precious")
    os.symlink(victims["latest.tmp"], os.path.join(out, "latest.tmp"))
    os.remove(os.path.join(out, "latest"))
    os.symlink(victims["latest"], os.path.join(out, "latest"))
    step2 = os.path.join(out, "step_2")
    os.makedirs(step2)
    os.symlink(victims["rank0.pt"], os.path.join(step2, "rank0.pt"))
    os.symlink(victims["meta.json"], os.path.join(step2, "meta.json"))
    assert checkpoint.save(rt, out, 2) == step2
    for v in victims.values():
        assert v.read_text() == "precious", v
    assert os.path.islink(os.path.join(out, "latest.tmp"))
    for p in ("latest", "step_2/rank0.pt", "step_2/meta.json"):
        assert not os.path.islink(os.path.join(out, p)), p
    assert open(os.path.join(out, "latest")).read() == "step_2\n"
    assert checkpoint.check(cfg, checkpoint.find("", out)) == 2
    assert not [
        f for f in os.listdir(out) + os.listdir(step2) if f.endswith(".tmp") and f != "latest.tmp"
    ]


def test_bad_latest_is_named(saved):
    cfg, out, path, rt = saved
    shutil.rmtree(path)
    open(os.path.join(out, "latest"), "wb").write(b"\xff\xfe../../etc")
    with pytest.raises(ValueError, match=r"latest must name a step directory like 'step_3'"):
        checkpoint.find("", out)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_cli_refuses_corrupt_checkpoint_before_launch(saved):
    """`train --resume` verifies every file's sha256 in the launcher: exit 2, file named, no
    ranks."""
    import subprocess
    import sys

    cfg, out, path, rt = saved
    _flip_tensor_byte(os.path.join(path, "rank0.pt"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "real_py", "train", "--resume", path, "--out-dir", out],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "rank0.pt fails its sha256 check" in r.stderr, r.stderr[-2000:]
    assert "launching" not in r.stdout


def test_meta_listing_other_paths_is_refused(saved):
    cfg, out, path, rt = saved
    meta = json.load(open(os.path.join(path, "meta.json")))
    meta["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "bytes": 1}
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    with pytest.raises(
        ValueError, match=r"meta.json lists files \['../../etc/passwd'\]; expected only rank<N>.pt"
    ):
        checkpoint.check(cfg, path)


def _verified_step(cfg, out):
    path = checkpoint.find("", out)
    return checkpoint.check(cfg, path), torch.load(
        os.path.join(path, "rank0.pt"), weights_only=True
    )


def test_killed_save_leaves_previous_step_whole(saved, monkeypatch):
    """A save killed between files (here: an exception where meta.json would be written) or
    between the renames of a re-saved step never leaves `latest` naming a step that does not
    verify; sweep() removes the leftovers and puts an .old step back."""
    cfg, out, path, rt = saved
    flat = rt.models.engines["actor"].shard.flat
    checkpoint.save(rt, out, 2)
    _, want = _verified_step(cfg, out)
    real_write, real_rename = checkpoint._write_atomic, os.rename

    def dies_at_meta(directory, name, data):
        if name == "meta.json":
            raise KeyboardInterrupt("killed between the rank files and meta.json")
        real_write(directory, name, data)

    flat += 1  # the re-save has other contents
    for step in (2, 3):  # re-saving an existing step, and a new one
        monkeypatch.setattr(checkpoint, "_write_atomic", dies_at_meta)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(rt, out, step)
        monkeypatch.setattr(checkpoint, "_write_atomic", real_write)
        step_k, got = _verified_step(cfg, out)
        assert step_k == 2 and torch.equal(
            got["models"]["actor"]["flat"], want["models"]["actor"]["flat"]
        )
        assert not os.path.exists(os.path.join(out, "step_3"))
    # Killed between moving the old step_2 away and moving the new one in.
    calls = []

    def dies_at_second_rename(a, b):
        calls.append(b)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", dies_at_second_rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(rt, out, 2)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not os.path.exists(os.path.join(out, "step_2"))
    # Stale per-file temporaries of a kill mid-file, in out_dir and in a step directory.
    open(os.path.join(out, ".latest.abc123.tmp"), "w").write("step_")
    open(os.path.join(path, ".rank0.pt.xyz.tmp"), "wb").write(b"half")
    keep = os.path.join(out, ".my_notes.tmp")
    open(keep, "w").write("not ours")
    done = checkpoint.sweep(out)
    assert any(d.startswith("restored step_2 from .step_2.") for d in done), done
    assert sorted(os.listdir(out)) == [".my_notes.tmp", "latest", "step_1", "step_2"], os.listdir(
        out
    )
    assert sorted(os.listdir(path)) == ["meta.json", "rank0.pt"]
    step_k, got = _verified_step(cfg, out)
    assert step_k == 2 and torch.equal(
        got["models"]["actor"]["flat"], want["models"]["actor"]["flat"]
    )
    assert checkpoint.sweep(out) == []
    # And a save after all that works and replaces step_2.
    checkpoint.save(rt, out, 2)
    step_k, got = _verified_step(cfg, out)
    assert step_k == 2 and torch.equal(got["models"]["actor"]["flat"], flat)
    assert sorted(os.listdir(out)) == [".my_notes.tmp", "latest", "step_1", "step_2"]


@pytest.mark.dist
def test_run_files_and_step_dirs_never_followed(saved, tmp_path):
    """metrics.jsonl, samples.jsonl, summary.json and step_N planted as links: the writers refuse
    (or replace a step link) and no target changes; the launcher refuses before any rank starts."""
    import subprocess
    import sys

    from real_py.rlhf.observe import RunLog
    from real_py.rlhf.rewards import write_samples

    cfg, out, path, rt = saved
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "rank0.pt").write_text("precious")
    os.symlink(victim_dir, os.path.join(out, "step_2"))
    assert checkpoint.save(rt, out, 2) == os.path.join(out, "step_2")
    assert (
        not os.path.islink(os.path.join(out, "step_2"))
        and checkpoint.check(cfg, os.path.join(out, "step_2")) == 2
    )
    assert (
        os.listdir(victim_dir) == ["rank0.pt"]
        and (victim_dir / "rank0.pt").read_text() == "precious"
    )
    victims = {
        n: tmp_path / f"victim_{n}" for n in ("metrics.jsonl", "samples.jsonl", "summary.json")
    }
    for n, v in victims.items():
        v.write_text("precious")
        os.symlink(v, os.path.join(out, n))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "real_py", "train", "--resume", "--out-dir", out],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and f"{out}/metrics.jsonl is a symbolic link" in r.stderr, r.stderr[
        -2000:
    ]
    assert "launching" not in r.stdout
    log = RunLog(out)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        log.log(
            {
                "step": 3,
                "seconds": 1.0,
                "metrics": {},
                "calls": {},
                "realloc_seconds": {},
                "realloc_bytes": 0,
                "data_bytes": 0,
            }
        )
    os.remove(os.path.join(out, "metrics.jsonl"))
    with pytest.raises(ValueError, match="summary.json is a symbolic link"):
        log.log(
            {
                "step": 3,
                "seconds": 1.0,
                "metrics": {"reward": 1.0},
                "calls": {},
                "realloc_seconds": {},
                "realloc_bytes": 0,
                "data_bytes": 0,
            }
        )
        log.close()
    with pytest.raises(ValueError, match="samples.jsonl is a symbolic link"):
        write_samples(os.path.join(out, "samples.jsonl"), 0, ["p"], ["r"], torch.zeros(1), [0])
    for v in victims.values():
        assert v.read_text() == "precious", v


def test_other_config_names_the_fields_that_differ(saved):
    """--resume with another config names the differing fields, not two whole dicts."""
    cfg, out, path, rt = saved
    other = CF.from_dict(
        {
            "actor": {"vocab_size": 128},
            "critic": {"vocab_size": 128},
            "plan": dict(CF.default_plan("ppo")),
        }
    )
    other.plan["calls"] = dict(
        other.plan["calls"], ref_inf={"ranks": [2, 3], "dp": 2, "tp": 1, "pp": 1}
    )
    with pytest.raises(ValueError) as e:
        checkpoint.check(other, path)
    msg = str(e.value)
    assert "models.actor.vocab_size is 64 in the checkpoint, 128 in this config" in msg, msg
    assert "plan.calls.ref_inf.ranks" in msg and "resume with the config that made it" in msg, msg
    assert len(msg) < 700 and "\n" not in msg, msg
    # An async checkpoint (its rank files hold queued rollouts) resumes only with its own bound and
    # row shapes; a synchronous one may continue in async mode.
    async_cfg = CF.from_dict({"async": {"max_staleness": 1}})
    assert checkpoint.check(async_cfg, path) == 1
    rt.cfg = async_cfg
    step2 = checkpoint.save(rt, out, 2)
    with pytest.raises(
        ValueError,
        match=r"async.max_staleness is 1 in the checkpoint, 0 in this config; "
        r"async.batch_size is 8 in the checkpoint, absent in this config",
    ):
        checkpoint.check(cfg, step2)


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_refused_rank_file_leaves_the_run_directory_unchanged(tmp_path):
    """A 2-rank run saves steps 1 and 2; rank 1's step-1 file is replaced by one holding a pickled
    callable, with meta.json's checksum made to match. `--resume step_1` is refused before launch
    (the launcher reads every rank file's content); under an outside torchrun rank 0 loads its
    file but rank 1 refuses: every rank fails, and metrics.jsonl / samples.jsonl keep every step,
    byte for byte (the records are cut only once every rank has loaded)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lay = {"ranks": [0, 1], "dp": 1, "tp": 2, "pp": 1}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        json.dumps(
            {
                "steps": 2,
                "save_every": 1,
                "reward": {"kind": "rule"},
                "generation": {"max_new_tokens": 4},
                "plan": {
                    "world_size": 2,
                    "calls": {n: lay for n in CF.default_plan("ppo")["calls"]},
                },
            }
        )
    )
    out = tmp_path / "run"
    train = [
        "-m",
        "real_py",
        "train",
        "--config",
        str(cfg),
        "--out-dir",
        str(out),
        "--no-progress",
        "--timeout",
        "60",
    ]
    r = subprocess.run(
        [sys.executable] + train, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    step1 = out / "step_1"
    rank_file = step1 / "rank1.pt"
    good = torch.load(rank_file, weights_only=True)
    torch.save(good | {"hook": _Plant(str(tmp_path / "code_ran"))}, rank_file)
    meta = json.loads((step1 / "meta.json").read_text())
    data = rank_file.read_bytes()
    meta["files"]["rank1.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step1 / "meta.json").write_text(json.dumps(meta))
    logs = {n: (out / n).read_bytes() for n in ("metrics.jsonl", "samples.jsonl")}
    assert len(logs["metrics.jsonl"].splitlines()) == 2
    resume = train + ["--resume", str(step1)]
    r = subprocess.run(
        [sys.executable] + resume, cwd=root, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and "rank1.pt refused: it holds more than tensors" in r.stderr, (
        r.stderr[-2000:]
    )
    assert "launching" not in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        + resume,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    assert "rank 1 could not load its checkpoint" in text and "nothing in" in text, text[-3000:]
    assert "dropped" not in text, text[-3000:]
    for n, before in logs.items():
        assert (out / n).read_bytes() == before, n
    assert not os.path.exists(tmp_path / "code_ran")
