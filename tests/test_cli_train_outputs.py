# Checks what `python -m real_py train` leaves behind on 4 gloo ranks (default plan: the actor
# trains on dp1tp2pp2 and generates on dp4tp1pp1, so weights move): HF export (end of run and
# `export` command) reloaded by transformers equals the saved shards bit for bit, TensorBoard events
# and summary.json match metrics.jsonl, `plot` writes the PNG, KEY=VALUE overrides reach the ranks,
# and an existing run directory is neither overwritten nor mixed into.
# A failure points to real_py/cli/export.py (gather / HF names), real_py/rlhf/observe.py (RunLog,
# summarize), real_py/cli/plot.py, or real_py/cli/train.py (override pass-through,
# _protect_run_dir).
"""The oracle for the export is tests/support/oracle.py: the reloaded full tensors are sliced into
every rank's flat buffer of the train layout by index math and compared with torch.equal to the
rank files the checkpoint wrote."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.oracle import oracle_flat

from real_py.cli import main
from real_py.cli import train as cli_train
from real_py.dataflow.execplan import ExecutionPlan
from real_py.dataflow.graph import ALGORITHMS, Graph
from real_py.interop.hf import hf_names
from real_py.rlhf import observe
from real_py.spec import ModelConfig, model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = tmp / "cfg.yaml"
    # steps: 5 in the file, steps=2 on the command line: only an override that reached the ranks
    # stops the run after two steps.
    cfg.write_text(
        "steps: 5\nsave_every: 1\nexport: hf\ngeneration: {max_new_tokens: 6}\n"
        "ppo: {ppo_epochs: 1}\n"
    )
    out = str(tmp / "run")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            str(cfg),
            "steps=2",
            "ppo.actor_lr=2e-3",
            "--out-dir",
            out,
            "--no-progress",
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp, out, r.stdout


def _hf_full(model_cls, path, spec):
    """Reload with transformers and fuse q/k/v and gate/up back into the spec's names."""
    sd = model_cls.from_pretrained(path, torch_dtype=torch.float32).state_dict()
    full = {}
    for p in spec.params:
        names = hf_names(p)
        full[p.name] = (
            sd[names[0]] if len(names) == 1 else torch.cat([sd[n] for n in names], p.tp.dim)
        )
    return full


def _check_export(export_dir, step_dir):
    """Every rank file of the train layouts equals the exported tensors sliced by the oracle."""
    import transformers

    meta = json.load(open(os.path.join(step_dir, "meta.json")))
    graph, plan = Graph(ALGORITHMS[meta["algo"]]), ExecutionPlan.from_json(meta["plan"])
    fulls = {}
    for m, cls in (
        ("actor", transformers.AutoModelForCausalLM),
        ("critic", transformers.AutoModelForSequenceClassification),
    ):
        spec = model_spec(ModelConfig(**meta["models"][m]), name=m)
        layout = plan.calls[graph.train_call(m)]
        full = fulls[m] = _hf_full(cls, os.path.join(export_dir, m), spec)
        for r in layout.ranks:
            saved = torch.load(os.path.join(step_dir, f"rank{r}.pt"), weights_only=True)["models"][
                m
            ]["flat"]
            assert torch.equal(oracle_flat(spec, layout, r, full), saved), (m, r, export_dir)
    return fulls


@pytest.mark.dist
@pytest.mark.timeout(500)
def test_export_matches_checkpoint_shards(run, tmp_path):
    tmp, out, stdout = run
    assert "exported" in stdout and "summary (steps 1-2" in stdout
    last = _check_export(os.path.join(out, "hf"), os.path.join(out, "step_2"))
    assert main(["export", "--run", out, "--step", "1", "--out", str(tmp_path / "e1")]) == 0
    first = _check_export(str(tmp_path / "e1"), os.path.join(out, "step_1"))
    assert main(["export", "--run", out, "--out", str(tmp_path / "e2")]) == 0  # latest = step 2
    _check_export(str(tmp_path / "e2"), os.path.join(out, "step_2"))
    # Step 2 trained on step 1: a stale export would pass the slicing check against a stale file.
    assert any(not torch.equal(first["actor"][k], last["actor"][k]) for k in last["actor"])
    with pytest.raises(SystemExit):
        main(["export", "--run", out, "--out", str(tmp_path / "e1")])  # never over an export


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_tensorboard_summary_plot(run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = run
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [1, 2]
    ea = EventAccumulator(out)
    ea.Reload()
    for tag, get in (
        ("train/reward", lambda r: r["metrics"]["reward"]),
        ("train/kl", lambda r: r["metrics"]["kl"]),
        ("time/step_seconds", lambda r: r["seconds"]),
        ("time/realloc/actor", lambda r: r["realloc_seconds"]["actor"]),
    ):
        ev = ea.Scalars(tag)
        assert [e.step for e in ev] == [1, 2], tag
        for e, r in zip(ev, recs):
            assert e.value == pytest.approx(get(r), rel=1e-6, abs=1e-7), tag
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s == observe.summarize(recs)
    assert s["steps"] == [1, 2] and s["window"] == 1
    assert (
        s["reward_first"] == recs[0]["metrics"]["reward"]
        and s["reward_last"] == recs[1]["metrics"]["reward"]
    )
    share = [sum(r["realloc_seconds"].values()) / r["seconds"] for r in recs]
    assert s["realloc_share"] == pytest.approx(sum(share) / 2) and 0 < s["realloc_share"] < 1
    png = tmp_path / "c.png"
    assert main(["plot", out, "--out", str(png)]) == 0
    import matplotlib.image

    assert (
        png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and matplotlib.image.imread(str(png)).shape[1] >= 800
    )


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_run_dir_protection(run, tmp_path, capsys, monkeypatch):
    """A finished run's directory: a plain rerun is refused with nothing changed; --resume is let
    through untouched; --overwrite deletes exactly the previous run's entries (not other files)
    before launching."""
    _, out, _ = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    launched = []
    monkeypatch.setattr(cli_train, "_launch", lambda args, world: launched.append(world) or 0)
    with pytest.raises(SystemExit) as e:
        main(["train", "--out-dir", str(copy), "steps=2"])
    assert e.value.code == 2 and "already holds a run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before and not launched
    assert main(["train", "--out-dir", str(copy), "steps=3", "--resume"]) == 0 and launched == [4]
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    launched.clear()
    assert main(["train", "--out-dir", str(copy), "steps=2", "--overwrite"]) == 0 and launched == [
        4
    ]
    assert sorted(os.listdir(copy)) == ["notes.txt"]


def test_wandb_opt_in(tmp_path, monkeypatch):
    """W&B: asked for and not installed -> a clear config error; asked for and present (a
    recording stand-in module) -> init with the options and config, every step's scalars, the
    summary, finish. Without the key RunLog never touches wandb."""
    import importlib.machinery
    import types

    from real_py.rlhf import config as CF

    if not observe.wandb_available():
        with pytest.raises(ValueError, match="wandb package is not installed"):
            CF.from_dict({"wandb": {"project": "p"}})
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        summary = {}

        def log(self, vals, step):
            calls.append(("log", step, vals["train/reward"]))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    rec = {
        "step": 1,
        "seconds": 2.0,
        "metrics": {"reward": 0.5, "kl": 0.1},
        "calls": {"actor_gen": 1.0},
        "realloc_seconds": {"actor": 0.5},
        "realloc_bytes": 10,
        "data_bytes": 5,
    }
    log = observe.RunLog(str(tmp_path / "a"), config={"steps": 1})
    log.log(rec)
    log.close()
    assert calls == []
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = observe.RunLog(
        str(tmp_path / "b"), wandb={"project": "p", "name": "n"}, config={"steps": 1}
    )
    log.log(rec)
    summary = log.close()
    assert calls == [
        ("init", {"config": {"steps": 1}, "project": "p", "name": "n"}),
        ("log", 1, 0.5),
        ("finish",),
    ]
    assert Run.summary == summary and summary["realloc_share"] == 0.25
