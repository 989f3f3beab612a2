# Checks that relative input paths written in a config file resolve against the file's folder (the
# shipped configs run from any directory), that KEY=VALUE overrides resolve against the working
# directory, and that a missing path is named with the base it was resolved against.
# A failure points to real_py/rlhf/config/paths.py (resolve_paths, path_origin), load.py (read_yaml)
# or files.py (check_input_files).
import os

import pytest

from real_py.cli import main
from real_py.cli import train as cli_train
from real_py.rlhf import config as CF

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "name",
    [
        "copy_task/ppo.yaml",
        "copy_task/grpo.yaml",
        "copy_task/grpo_moe.yaml",
        "recipes/dapo.yaml",
        "recipes/remax.yaml",
    ],
)
def test_shipped_config_validates_from_another_directory(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    cfg = CF.load(os.path.join(ROOT, "configs", name))
    assert cfg.data.path == os.path.join(ROOT, "configs", "copy_task", "prompts.jsonl")
    assert cfg.reward.path == os.path.join(ROOT, "configs", "copy_task", "reward.py") + ":copy_last"
    CF.validate(cfg, 4)
    # The same with the config named relatively from a sibling directory.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rel = os.path.relpath(os.path.join(ROOT, "configs", name))
    CF.validate(CF.load(rel), 4)


def test_cli_validates_shipped_config_from_another_directory(tmp_path, monkeypatch):
    """`train --config <repo>/configs/copy_task/ppo.yaml` run from elsewhere gets to the launch."""
    launched = []
    monkeypatch.setattr(cli_train, "_launch", lambda args, world: launched.append(world) or 0)
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "train",
                "--config",
                os.path.join(ROOT, "configs", "copy_task", "ppo.yaml"),
                "--out-dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert launched == [4]


def test_overrides_resolve_against_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "c.yaml").write_text(
        "data: {path: p.jsonl}\nout_dir: runs/y\nreward: {kind: function, path: 'os.path:join'}\n"
    )
    monkeypatch.chdir(tmp_path)
    d = CF.read_yaml("cfgs/c.yaml")
    assert d["data"]["path"] == os.path.join("cfgs", "p.jsonl")
    assert d["out_dir"] == "runs/y" and d["reward"]["path"] == "os.path:join"  # an output; a module
    assert CF.apply_overrides(d, ["data.path=p.jsonl"])["data"]["path"] == "p.jsonl"


@pytest.mark.parametrize(
    "text, key, value, phrase",
    [
        (
            "data: {path: nope.jsonl, tokenizer_path: tok}",
            "data.path",
            "nope.jsonl",
            "no such file",
        ),
        ("data: {tokenizer_path: tok}", "data.tokenizer_path", "tok", "no such directory"),
        ("reward: {kind: function, path: 'r.py:f'}", "reward.path", "r.py:f", "no such file"),
        ("plan: {path: plan.json}", "plan.path", "plan.json", "no such file"),
        ("actor_path: ckpt/sft", "actor_path", "ckpt/sft", "no such local file or directory"),
    ],
)
def test_missing_path_names_its_base(tmp_path, monkeypatch, text, key, value, phrase):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "c.yaml").write_text(text + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        CF.load("cfgs/c.yaml")
    msg = str(e.value)
    assert f"config {key}=" in msg and phrase in msg, msg
    assert (
        f"in cfgs/c.yaml: relative paths in a config file resolve against the file's folder, "
        f"{tmp_path / 'cfgs'}" in msg
    ), msg
    # The same path given on the command line: the working directory is the base.
    with pytest.raises(ValueError) as e:
        CF.load(
            None, [f"{key}={value}"] + (["reward.kind=function"] if key == "reward.path" else [])
        )
    msg = str(e.value)
    assert (
        f"config {key}='{value}'" in msg
        and f"resolved against the working directory {tmp_path}" in msg
    ), msg
