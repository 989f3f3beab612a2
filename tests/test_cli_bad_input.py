# Checks that bad input to the train / plan / search / export / plot commands and to train configs
# (YAML or KEY=VALUE) is refused before any rank starts, with one line naming the key/flag/file and
# what was expected, and that no input or existing checkpoint file changes; and that good-but-loose
# input (numeric strings, overrides) is typed right.
# A failure points to real_py/rlhf/config/ (_coerce, ranged fields of schema.py / ranges.py,
# apply_overrides, read_yaml), real_py/cli/train.py (_config, _protect_run_dir),
# real_py/cli/common.py, real_py/dataflow/execplan.py (from_json messages) or the command modules.
"""Every case runs `real_py.cli.main(argv)` in this process with the launcher replaced by a
failing stub, so an input that wrongly passed validation fails the test instead of starting
torchrun. Bad input must end in SystemExit(2) with a single `error: ...` line on stderr."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from real_py.cli import main
from real_py.cli import train as cli_train
from real_py.interop.hf import hf_config_dict
from real_py.rlhf import config as CF

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MOE = (
    "{model_type: qwen3_moe, qk_norm: true, num_experts: 4, num_experts_per_tok: 2, "
    "moe_intermediate_size: 64, norm_topk_prob: true}"
)

# (case id, YAML text of cfg.yaml, extra argv, phrase of the message). Every train case points
# --out-dir at `run`, a directory holding a previous run's checkpoint, which must stay untouched.
TRAIN = [
    (
        "override-after-option",
        "",
        ["steps=2", "--timeout", "30", "ppo.clip=big"],
        "ppo.clip='big': expected a number",
    ),
    (
        "not-an-override",
        "",
        ["steps=2", "--timeout", "30", "bogus"],
        "override 'bogus': expected KEY=VALUE",
    ),
    ("save_every<0", "save_every: -5", [], "save_every=-5 is out of range; allowed: >= 0"),
    ("clip<0", "ppo: {clip: -0.2}", [], "ppo.clip=-0.2 is out of range; allowed: > 0"),
    ("lam<0", "ppo: {lam: -0.5}", [], "ppo.lam=-0.5 is out of range; allowed: [0, 1]"),
    ("gamma>1", "ppo: {gamma: 3.0}", [], "ppo.gamma=3.0 is out of range; allowed: [0, 1]"),
    (
        "value_clip=0",
        "ppo: {value_clip: 0}",
        [],
        "ppo.value_clip=0.0 is out of range; allowed: > 0",
    ),
    ("lr<0", "ppo: {critic_lr: -1e-3}", [], "ppo.critic_lr=-0.001 is out of range; allowed: > 0"),
    (
        "temperature=0",
        "generation: {temperature: 0}",
        [],
        "generation.temperature=0.0 is out of range",
    ),
    (
        "top_p>1",
        "generation: {top_p: 1.5}",
        [],
        "generation.top_p=1.5 is out of range; allowed: (0, 1]",
    ),
    (
        "min_new_tokens<0",
        "generation: {min_new_tokens: -1}",
        [],
        "generation.min_new_tokens=-1 is out of range; allowed: >= 0 (0: off)",
    ),
    (
        "min>max_new_tokens",
        "generation: {min_new_tokens: 13, max_new_tokens: 12}",
        [],
        "generation.min_new_tokens=13 exceeds generation.max_new_tokens=12",
    ),
    (
        "eos>vocab",
        "generation: {eos_token_id: 5000}",
        [],
        "generation.eos_token_id=5000 is outside the actor vocabulary; allowed: 0 .. 63",
    ),
    (
        "target>vocab",
        "reward: {kind: rule, target_token: 1000}",
        [],
        "reward.target_token=1000 is outside the actor vocabulary; allowed: 0 .. 63",
    ),
    (
        "actor_lr=1e400",
        "",
        ["ppo.actor_lr=1e400"],
        "ppo.actor_lr='1e400': expected a finite number, got inf",
    ),
    (
        "kl_coef=.inf",
        "ppo: {kl_coef: .inf}",
        [],
        "ppo.kl_coef=inf: expected a finite number, got inf",
    ),
    (
        "temperature=.inf",
        "",
        ["generation.temperature=.inf"],
        "generation.temperature=inf: expected a finite",
    ),
    ("clip=-.inf", "ppo: {clip: -.inf}", [], "ppo.clip=-inf: expected a finite number"),
    ("lr=nan", "ppo: {critic_lr: .nan}", [], "ppo.critic_lr=nan: expected a finite number"),
    (
        "actor-field-inf",
        "actor: {rope_theta: .inf}",
        [],
        "actor.rope_theta=inf: expected a finite number",
    ),
    ("steps=ten", "steps: ten", [], "steps='ten': expected an integer"),
    ("steps=2.5", "steps: 2.5", [], "steps=2.5: expected an integer"),
    ("clip=big", "ppo: {clip: big}", [], "ppo.clip='big': expected a number"),
    (
        "greedy=yes",
        "generation: {greedy: yes}",
        [],
        "generation.greedy='yes': expected true or false",
    ),
    ("bool=1", "verify_realloc: 1", [], "verify_realloc=1: expected true or false"),
    ("export=onnx", "export: onnx", [], "export='onnx': expected one of 'hf' or null"),
    ("section-not-mapping", "ppo: 3", [], "config ppo: expected a mapping, got int"),
    ("unknown-key", "ppo: {epochs: 3}", [], "ppo: unknown keys ['epochs']"),
    (
        "actor-field-type",
        "actor: {hidden_size: wide}",
        [],
        "actor.hidden_size='wide': expected an integer",
    ),
    (
        "hub-id",
        "actor_path: meta-llama/Llama-2-7b-hf",
        [],
        "only local HF checkpoint directories are read",
    ),
    ("plan-no-calls", "plan: {world_size: 4}", [], "execution plan lacks ['calls']"),
    ("plan-malformed-json", "plan: {path: PLAN_BAD}", [], "is not valid JSON"),
    (
        "plan-call-not-mapping",
        "plan: {world_size: 4, calls: {actor_gen: 3}}",
        [],
        "call actor_gen must be a mapping with a list of ranks",
    ),
    ("yaml-syntax", "ppo: {clip: [", [], "is not valid YAML"),
    ("override-bad-type", "", ["steps=ten"], "steps='ten': expected an integer"),
    ("override-unknown", "", ["ppo.bogus=1"], "ppo: unknown keys ['bogus']"),
    ("override-no-value", "", ["ppo.actor_lr"], "expected KEY=VALUE"),
    ("override-range", "", ["ppo.gamma=3"], "ppo.gamma=3.0 is out of range"),
    ("override-under-scalar", "", ["steps.x=1"], "steps={'x': 1}: expected an integer"),
    ("override-after-resume", "", ["--resume", "steps=ten"], "steps='ten': expected an integer"),
    ("timeout=0", "", ["--timeout", "0"], "--timeout=0.0 must be > 0"),
    (
        "resume+overwrite",
        "",
        ["--resume", "--overwrite"],
        "--resume and --overwrite exclude each other",
    ),
    # --resume X without X/meta.json must name X, never fall back to out_dir/latest.
    (
        "resume-typo",
        "",
        ["--resume", "RUN/step_9"],
        "run/step_9: no checkpoint: does not exist; give a step directory",
    ),
    (
        "resume-incomplete-step",
        "",
        ["--resume", "EMPTY"],
        "empty: no checkpoint: has no meta.json (not a complete checkpoint step)",
    ),
    ("existing-run", "", [], "already holds a run"),
    # Combinations the ranks refused after start-up, now refused before launch.
    (
        "moe-async",
        f"algo: grpo\nactor: {MOE}\nasync: {{max_staleness: 1}}",
        [],
        "async.max_staleness=1 with a mixture-of-experts model (actor, ref): "
        "asynchronous RL is not implemented",
    ),
    (
        "decode-graph-on-cpu",
        "device: cpu\ngeneration: {decode: graph}",
        [],
        "generation.decode='graph' needs CUDA, tp=1 on the generation calls and a dense actor, "
        "but the device is CPU",
    ),
    (
        "decode-static-window",
        "actor: {model_type: mistral, sliding_window: 4}\ngeneration: {decode: static}",
        [],
        "generation.decode='static' needs an actor without sliding-window attention",
    ),
    (
        "export-random-moe",
        f"algo: grpo\nactor: {MOE}\nexport: hf",
        [],
        "export: hf with a random-init mixture-of-experts actor",
    ),
    (
        "qkv-layout",
        "actor: {qkv_layout: megatron_grouped}",
        [],
        "actor.qkv_layout='megatron_grouped': the train engines compute on blocked fused tensors",
    ),
]

OTHER = [  # (case id, argv, phrase); PLAN_BAD / HF_CFG / RUN are replaced by paths
    (
        "plan-from-without-plan",
        ["plan", "--from", "actor_train", "--to", "actor_gen"],
        "give --plan FILE too",
    ),
    (
        "plan-plan-without-to",
        ["plan", "--plan", "PLAN_BAD", "--from", "actor_train"],
        "--plan needs --from CALL and --to CALL",
    ),
    (
        "plan-plan-two-models",
        ["plan", "--plan", "PLAN_OK", "--from", "actor_train", "--to", "critic_inf"],
        "--from actor_train runs the actor model, --to critic_inf the critic model",
    ),
    (
        "plan-plan-bad-json",
        ["plan", "--plan", "PLAN_BAD", "--from", "actor_train", "--to", "actor_gen"],
        "is not valid JSON",
    ),
    ("bench-one-side", ["bench", "--src", "tp2"], "give --src and --dst together"),
    (
        "bench-1001-procs",
        ["bench", "--src", "tp2", "--src-ranks", "0,1000", "--dst", "dp2"],
        "1001 local processes, more than the 64",
    ),
    (
        "bench-70b-on-cpu",
        ["bench", "--model", "llama2-70b", "--src", "tp2", "--dst", "dp2"],
        "GiB is available; pick a smaller model",
    ),
    (
        "plan-unknown-preset",
        ["plan", "--model", "llama3", "--src", "dp2", "--dst", "tp2"],
        "--model 'llama3' is neither a preset (llama2-7b, llama2-13b, codellama-34b, llama2-70b, "
        "llama3.1-405b, moe-tiny, qwen3-30b-a3b, qwen3-235b-a22b, kimi-k2-shaped) "
        "nor an existing HF config.json",
    ),
    (
        "plan-src-ranks",
        ["plan", "--src", "dp2", "--dst", "tp2", "--src-ranks", "0,x"],
        "--src-ranks '0,x': expected comma-separated non-negative integers",
    ),
    (
        "plan-dst-ranks",
        ["plan", "--src", "dp2", "--dst", "tp2", "--dst-ranks", "1;2"],
        "--dst-ranks '1;2'",
    ),
    (
        "plan-bad-hf-json",
        ["plan", "--model", "PLAN_BAD", "--src", "dp2", "--dst", "tp2"],
        "bad.json: not valid JSON",
    ),
    (
        "search-time-budget",
        ["search", "--gpus", "8", "--time-budget", "-1"],
        "--time-budget=-1.0 must be > 0",
    ),
    ("search-batch", ["search", "--gpus", "8", "--batch-size", "0"], "--batch-size=0 must be > 0"),
    ("search-unknown-preset", ["search", "--gpus", "8", "--model", "llama3"], "neither a preset"),
    (
        "search-vllm-logp-without-vllm",
        ["search", "--gpus", "8", "--vllm-logp", "rollout"],
        "--vllm-logp rollout needs --engine vllm",
    ),
    (
        "search-bad-critic",
        ["search", "--gpus", "8", "--critic", "nope/x"],
        "--critic 'nope/x' is neither",
    ),
    (
        "export-not-a-run",
        ["export", "--run", "EMPTY", "--out", "EMPTY/x"],
        "latest (not a train run directory",
    ),
    (
        "export-missing-step",
        ["export", "--run", "RUN", "--step", "9", "--out", "EMPTY/x"],
        "no checkpoint at",
    ),
    ("plot-not-a-run", ["plot", "EMPTY"], "no metrics.jsonl"),
]


def _snapshot(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = (
                    hashlib.sha256(fh.read()).hexdigest(),
                    os.stat(p).st_mtime_ns,
                )
    return out


@pytest.fixture
def env(tmp_path, monkeypatch):
    def no_launch(args, world):
        raise AssertionError("bad input reached the torchrun launch")

    monkeypatch.setattr(cli_train, "_launch", no_launch)
    run = tmp_path / "run"
    (run / "step_1").mkdir(parents=True)
    (run / "step_1" / "rank0.pt").write_bytes(os.urandom(256))
    (run / "step_1" / "meta.json").write_text('{"step": 1}')
    (run / "latest").write_text("step_1\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "bad.json").write_text('{"world_size": 4, "calls": {')
    (tmp_path / "ok.json").write_text(json.dumps(CF.default_plan("ppo")))
    (tmp_path / "empty").mkdir()
    return tmp_path


def _expect_error(argv, phrase, capsys, root):
    before = _snapshot(root)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert phrase in err, err
    assert _snapshot(root) == before, "an input or existing file changed"


@pytest.mark.parametrize("case, yaml_text, extra, phrase", TRAIN, ids=[c[0] for c in TRAIN])
def test_train_refuses(env, capsys, case, yaml_text, extra, phrase):
    cfg = env / "cfg.yaml"
    cfg.write_text(yaml_text.replace("PLAN_BAD", str(env / "bad.json")) + "\n")
    subs = {"EMPTY": str(env / "empty"), "RUN": str(env / "run")}
    for k, v in subs.items():
        extra = [v + a[len(k) :] if a.startswith(k) else a for a in extra]
    _expect_error(
        ["train", "--config", str(cfg), "--out-dir", str(env / "run")] + extra, phrase, capsys, env
    )


@pytest.mark.parametrize("case, argv, phrase", OTHER, ids=[c[0] for c in OTHER])
def test_commands_refuse(env, capsys, case, argv, phrase):
    subs = {
        "PLAN_BAD": str(env / "bad.json"),
        "PLAN_OK": str(env / "ok.json"),
        "EMPTY": str(env / "empty"),
        "RUN": str(env / "run"),
    }
    for k, v in subs.items():
        argv = [v + a[len(k) :] if a.startswith(k) else a for a in argv]
    _expect_error(argv, phrase, capsys, env)


@pytest.mark.parametrize(
    "d, key, want",
    [
        ({"data": {"batch_size": "8"}}, "data.batch_size", 8),  # numeric strings are coerced
        ({"ppo": {"actor_lr": "1e-5"}}, "ppo.actor_lr", 1e-5),  # PyYAML's reading of 1e-5
        ({"steps": 4.0}, "steps", 4),  # an integral float is an int
        ({"ppo": {"clip": 1}}, "ppo.clip", 1.0),
        ({"generation": {"eos_token_id": "3"}}, "generation.eos_token_id", 3),
        ({"generation": {"eos_token_id": None}}, "generation.eos_token_id", None),
        (
            {"actor": dict(CF.TINY, max_position_embeddings="128")},
            "actor",
            dict(CF.TINY, max_position_embeddings=128),
        ),
    ],
)
def test_coerced(d, key, want):
    cfg = CF.from_dict(d)
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert got == want and type(got) is type(want), (got, want)


def test_yaml_and_overrides_typed(tmp_path):
    """A YAML file with PyYAML's string 1e-5, then dotted overrides (one replacing the plan by a
    plan file): the resulting config has the override values, typed."""
    plan = dict(
        CF.DEFAULT_PLAN,
        calls=dict(CF.DEFAULT_PLAN["calls"], ref_inf={"ranks": [2, 3], "dp": 1, "tp": 2, "pp": 1}),
    )
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "c.yaml").write_text(
        "ppo: {actor_lr: 1e-5, clip: 0.3}\ngeneration: {greedy: True}\n"
        "plan: {world_size: 4, calls: {}}\n"
    )
    cfg = CF.load(
        str(tmp_path / "c.yaml"),
        [
            "ppo.critic_lr=2e-4",
            f"plan.path={tmp_path / 'plan.json'}",
            "steps=3",
            "actor.num_hidden_layers=2",
            "data.batch_size='8'",
        ],
    )
    assert cfg.ppo.actor_lr == 1e-5 and cfg.ppo.critic_lr == 2e-4 and cfg.ppo.clip == 0.3
    assert cfg.steps == 3 and cfg.generation.greedy is True and cfg.data.batch_size == 8
    assert cfg.actor == {"num_hidden_layers": 2}
    assert cfg.execution_plan().calls["ref_inf"].tp == 2
    CF.validate(cfg, 4)
    # Without a plan in the file, plan.calls.* overrides edit the default plan.
    cfg = CF.load(None, ["plan.calls.ref_inf.tp=2", "plan.calls.ref_inf.dp=1"])
    assert (
        cfg.execution_plan().calls["ref_inf"].tp == 2
        and cfg.execution_plan().calls["actor_gen"].dp == 4
    )
    CF.validate(cfg, 4)
    assert CF.DEFAULT_PLAN["calls"]["ref_inf"]["tp"] == 1
    # The file itself is untouched by overrides.
    assert "critic_lr" not in (tmp_path / "c.yaml").read_text()


@pytest.mark.dist
def test_search_accepts_hf_config(tmp_path, capsys):
    """`search --model cfg.json` takes an HF config file as `plan --model` does."""
    hf = hf_config_dict(CF.from_dict({}).model_configs()["actor"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert (
        main(
            [
                "search",
                "--model",
                str(tmp_path / "config.json"),
                "--gpus",
                "4",
                "--hardware",
                "cpu",
                "--batch-size",
                "8",
                "--prompt-len",
                "8",
                "--gen-len",
                "8",
                "--time-budget",
                "0.3",
                "--chains",
                "1",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert set(out["plan"]["calls"]) >= {"actor_gen", "actor_train"}
    assert main(["plan", "--model", str(tmp_path), "--src", "dp2", "--dst", "tp2", "--json"]) == 0


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_error_is_one_line_without_traceback(tmp_path):
    """The real command in a subprocess: exit 2, one stderr line, no traceback, nothing launched."""
    (tmp_path / "c.yaml").write_text("steps: ten\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "real_py",
            "train",
            "--config",
            str(tmp_path / "c.yaml"),
            "--out-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr == "error: config steps='ten': expected an integer\n", (
        r.stderr
    )
    assert "launching" not in r.stdout and not (tmp_path / "run").exists()


def test_bench_gpu_memory_checked_before_launch(env, capsys, monkeypatch):
    """--device cuda: a pair whose shards do not fit one GPU's free memory is refused before any
    process starts (CUDA faked: 8 GPUs of 80 GiB with 10 GiB free each)."""
    import torch

    from real_py.cli import bench as cli_bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (10 << 30, 80 << 30))
    monkeypatch.setattr(
        cli_bench, "_launch", lambda args, n: (_ for _ in ()).throw(AssertionError("launched"))
    )
    _expect_error(
        ["bench", "--device", "cuda", "--model", "llama2-70b", "--src", "tp4", "--dst", "tp2"],
        "rank 0's shards of dp1tp4pp1 -> dp1tp2pp1 need about 96.9 GiB, but cuda:0 has 10.0 "
        "of 80.0 GiB free",
        capsys,
        env,
    )
