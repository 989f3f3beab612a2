"""Checkpoints: per-rank shards of the trained models with their optimizer state, step, RNG.

    <out_dir>/step_<k>/meta.json      algo, model configs, execution plan, step, and the sha256
                                      and size of every rank file (rank 0)
    <out_dir>/step_<k>/rank<r>.pt     {model: {"flat", "exp_avg", "exp_avg_sq", "num_steps",
                                               "master"}},
                                      step, torch RNG state (every rank that holds a trained shard)
    <out_dir>/latest                  name of the newest complete step directory

Frozen models (reference, reward) are rebuilt from the seed, which meta.json records.

Atomic per step: every rank writes its file into a fresh hidden directory
`.step_<k>.<random>.tmp` of out_dir, rank 0 adds meta.json and renames the directory to
`step_<k>` (an existing step_<k>, re-saved after a resume, is first renamed to
`.step_<k>.<random>.old` and removed after). `latest` is written after that and a barrier. So a
kill at any point leaves every step_<k> whole (verifies) or absent, and `latest` naming a whole
step; `sweep(out_dir)`, run before a resume, removes what a kill left (temporary directories and
files) and puts back an .old step whose replacement never arrived.

Safety: rank files hold only tensors, ints, strings and None and are read with
`torch.load(weights_only=True)`, so a crafted file cannot run code; its sha256 is checked against
meta.json first, so a flipped byte or a truncated file is refused naming the file. Every file is
written to a fresh temporary name (tempfile: O_CREAT | O_EXCL, never follows a planted symlink)
in its final directory and moved into place with os.replace.

One file past 400 lines: save and sweep (writing) and read_meta, read_rank_file, check, load and
resume (reading) are the two halves of the on-disk format and of the atomicity and safety rules
above, so a change to the format is made and checked in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import tempfile

import torch
import torch.distributed as dist

from ..engines.train import Trainer


def _meta(cfg) -> dict:
    # Through JSON so tuples (rope_scaling, window_layers) compare equal to what meta.json reads
    # back.
    models = json.loads(
        json.dumps({m: dataclasses.asdict(c) for m, c in cfg.model_configs().items()})
    )
    k = cfg.async_.max_staleness
    # Async mode: the rank files hold queued rollouts, whose shapes follow the batch and lengths.
    rows = (
        {
            "batch_size": cfg.data.batch_size,
            "max_prompt_len": cfg.data.max_prompt_len,
            "max_new_tokens": cfg.generation.max_new_tokens,
        }
        if k
        else {}
    )
    return {
        "algo": cfg.algo,
        "seed": cfg.seed,
        "models": models,
        "paths": cfg.model_paths(),
        "plan": cfg.execution_plan().to_json(),
        "reward": cfg.reward.kind,
        "async": {"max_staleness": k, **rows},
    }


def _write_atomic(directory: str, name: str, data: bytes) -> None:
    """Write `data` to directory/name via a new temporary file and os.replace (no fixed temp
    name)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; checkpoints are read by other tools too
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Remove a file, a link (never what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _move_into_place(tmp: str, final: str) -> None:
    """Rename the complete directory `tmp` to `final`; an existing `final` (a directory, or a
    planted link: replaced, never followed) goes to an .old name first and is removed after."""
    old = None
    if os.path.lexists(final):
        old = tmp[: -len(".tmp")] + ".old"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final) or ".")
    if old is not None:
        _remove(old)


def save(rt, out_dir: str, step: int) -> str:
    """Collective. Saves after `step` iterations completed; returns the directory."""
    final = os.path.join(out_dir, f"step_{step}")
    rank = dist.get_rank()
    where = [None]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        where[0] = tempfile.mkdtemp(dir=out_dir, prefix=f".step_{step}.", suffix=".tmp")
        os.chmod(where[0], 0o755)  # mkdtemp makes 0700; checkpoints are read by other tools too
    dist.broadcast_object_list(where, src=0)
    path = where[0]
    # The adaptive KL coefficient and running reward moments carry across steps like the RNG.
    state = {"step": step, "rng": torch.get_rng_state(), "models": {}}
    if hasattr(rt, "kl_coef"):  # a Runtime (tests may pass a bare holder of models)
        state |= {"kl_coef": float(rt.kl_coef), "reward_moments": rt.reward_moments.clone()}
    if getattr(rt, "astate", None) is not None:
        # Async mode: the queued batches' rows this rank holds, their versions, the row ledger.
        state["async"] = rt.astate.state_dict()
    for m, eng in rt.models.engines.items():
        if eng is None or eng.optim is None:
            continue
        tr = eng._trainer
        state["models"][m] = {
            "flat": eng.shard.flat.clone(),
            "layout": str(eng.layout),
            "exp_avg": None if tr is None else tr.exp_avg,
            "exp_avg_sq": None if tr is None else tr.exp_avg_sq,
            "num_steps": 0 if tr is None else tr.num_steps,
            "master": None if tr is None else tr.master,
        }
        if (
            getattr(eng, "experts", None) is not None
        ):  # MoE: the expert shard and its optimizer buffers
            ex = None if tr is None else tr.experts
            state["models"][m]["experts"] = {
                "flat": eng.experts.flat.clone(),
                "exp_avg": None if ex is None else ex.exp_avg,
                "exp_avg_sq": None if ex is None else ex.exp_avg_sq,
                "master": None if ex is None else ex.master,
            }
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"rank{rank}.pt"
    _write_atomic(path, name, data)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, (name, hashlib.sha256(data).hexdigest(), len(data)))
    if rank == 0:
        files = {n: {"sha256": h, "bytes": size} for n, h, size in digests}
        meta = _meta(rt.cfg) | {"step": step, "files": files}
        _write_atomic(path, "meta.json", json.dumps(meta, indent=1).encode())
        _fsync_dir(path)
        _move_into_place(path, final)
    dist.barrier()
    if rank == 0:
        _write_atomic(out_dir, "latest", f"step_{step}\n".encode())
    return final


_STEP_TEMP = re.compile(r"^\.(step_\d+)\..+\.(tmp|old)$")
_FILE_TEMP = re.compile(r"^\.(latest|cut|rank\d+\.pt|meta\.json)\..+\.tmp$")


def sweep(out_dir: str) -> list[str]:
    """Clean up after a save that was killed: remove temporary step directories and temporary
    files (names this module and observe.cut_after create, nothing else), and rename an .old step
    back to step_<k> when step_<k> itself is missing (killed between the two renames of a
    re-save). Returns what it did, one line per entry. Run by one process before a resume."""
    done = []
    if not os.path.isdir(out_dir):
        return done
    for n in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, n)
        m = _STEP_TEMP.match(n)
        if m and m.group(2) == "old" and not os.path.lexists(os.path.join(out_dir, m.group(1))):
            os.rename(p, os.path.join(out_dir, m.group(1)))
            done.append(f"restored {m.group(1)} from {n}")
        elif m or _FILE_TEMP.match(n):
            _remove(p)
            done.append(f"removed {p}")
        elif n.startswith("step_") and os.path.isdir(p) and not os.path.islink(p):
            for f in sorted(os.listdir(p)):  # per-file temporaries of older versions
                if _FILE_TEMP.match(f):
                    _remove(os.path.join(p, f))
                    done.append(f"removed {os.path.join(p, f)}")
    return done


def find(resume: str, out_dir: str) -> str:
    """The checkpoint directory to resume from: out_dir/latest for an empty `resume` (bare
    --resume), `resume` itself when it is a step directory (holds meta.json), or resume/latest
    when it is a run directory. Anything else (a typo, an incomplete step) is refused naming it,
    never replaced by out_dir/latest."""
    if not resume:
        return latest(out_dir, "--resume:")
    if os.path.isfile(os.path.join(resume, "meta.json")):
        return resume
    if os.path.isfile(os.path.join(resume, "latest")):
        return latest(resume, f"--resume {resume}:")
    why = (
        "does not exist"
        if not os.path.exists(resume)
        else "has no meta.json (not a complete checkpoint step) and no latest marker "
        "(not a run directory)"
    )
    raise ValueError(
        f"--resume {resume}: no checkpoint: {why}; give a step directory such as "
        f"{os.path.join(out_dir, 'step_3')}, or --resume alone for "
        f"{os.path.join(out_dir, 'latest')}"
    )


def latest(out_dir: str, what: str = "") -> str:
    """out_dir/step_<k> as out_dir/latest names it; ValueError (prefixed by `what`) when the
    marker is missing or names anything but a step directory of out_dir."""
    marker = os.path.join(out_dir, "latest")
    if not os.path.isfile(marker):
        raise ValueError(
            f"{what} no {marker} (not a train run directory, or no checkpoint saved: "
            "set save_every)".strip()
        )
    with open(marker, "rb") as f:
        raw = f.read(4096)
    try:
        name = raw.decode().strip()
    except UnicodeDecodeError:
        name = ""
    if not name.startswith("step_") or not name[5:].isdigit():
        raise ValueError(f"{marker} must name a step directory like 'step_3', got {raw[:40]!r}")
    return os.path.join(out_dir, name)


def read_meta(path: str) -> dict:
    file = os.path.join(path, "meta.json")
    try:
        with open(file, "rb") as f:
            meta = json.loads(f.read().decode())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path}: no meta.json ({file})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"checkpoint file {file} is not valid JSON ({e}); the checkpoint is "
            "corrupt, resume from another step"
        ) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "step" not in meta:
        raise ValueError(
            f"checkpoint file {file} has no 'step' or no per-file checksums ('files'); "
            "it was not written by this version of real_py"
        )
    bad = [
        n
        for n in meta["files"]
        if not (n.startswith("rank") and n.endswith(".pt") and n[4:-3].isdigit())
    ]
    if bad:
        raise ValueError(f"checkpoint file {file} lists files {bad[:3]}; expected only rank<N>.pt")
    return meta


def _read_verified(path: str, name: str, meta: dict) -> bytes:
    """The bytes of path/name after checking its size and sha256 against meta.json."""
    file = os.path.join(path, name)
    want = meta["files"].get(name)
    if not isinstance(want, dict) or not isinstance(want.get("sha256"), str):
        raise ValueError(f"checkpoint {path}/meta.json lists no checksum for {name}")
    try:
        with open(file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {file} is missing (listed in meta.json)") from None
    if len(data) != want.get("bytes"):
        raise ValueError(
            f"checkpoint file {file} has {len(data)} bytes, meta.json says "
            f"{want.get('bytes')}: truncated or corrupt, resume from another step"
        )
    if hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise ValueError(
            f"checkpoint file {file} fails its sha256 check against meta.json: "
            "corrupt, resume from another step"
        )
    return data


def read_rank_file(path: str, rank: int) -> dict:
    """Verified, pickle-free read of path/rank<rank>.pt (tensors, ints, strings, None only)."""
    name = f"rank{rank}.pt"
    data = _read_verified(path, name, read_meta(path))
    return _load_safe(os.path.join(path, name), data=data)


def _load_safe(file: str, data: bytes | None = None, mmap: bool = False) -> dict:
    """torch.load(weights_only=True) of `data` (the verified bytes of `file`) or of `file` itself;
    ValueError naming the file when it holds more than tensors and plain values."""
    try:
        return torch.load(
            io.BytesIO(data) if data is not None else file, weights_only=True, mmap=mmap
        )
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        # torch's text advises weights_only=False, which would run the file's code:
        # name the cause only.
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0])
        raise ValueError(
            f"checkpoint file {file} refused: it holds more than tensors and plain values "
            f"(torch.load weights_only=True: {why}); it was not written by real_py or was "
            "altered: resume from another step"
        ) from None


_ABSENT = object()


def _diff(a, b, key: str) -> list[tuple]:
    """(dotted key, checkpoint value, config value) for every leaf where a and b differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in list(b) + [k for k in a if k not in b]  # the config's order first
            for d in _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{key}.{k}")
        ]
    return [] if a == b else [(key, a, b)]


def _short(v) -> str:
    if v is _ABSENT:
        return "absent"
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check(cfg, path: str, *, verify_files: bool = True) -> int:
    """Raise ValueError if the checkpoint was made for other models or another plan, or (with
    verify_files) any of its files is corrupt (sha256); returns its step. The launcher runs it
    before any rank starts; each rank's load() verifies its own file again."""
    meta = read_meta(path)
    mine = _meta(cfg)
    # A synchronous checkpoint may be resumed in async mode (the queue starts empty); an async
    # one only with its own bound and row shapes (its queued rollouts).
    saved_async = isinstance(meta.get("async"), dict) and meta["async"].get("max_staleness")
    keys = ("algo", "models", "paths", "plan", "seed", "reward") + (
        ("async",) if saved_async else ()
    )
    diffs = [d for k in keys for d in _diff(meta.get(k), mine[k], k)]
    if diffs:
        more = (
            f" (and {len(diffs) - 3} more: {', '.join(d[0] for d in diffs[3:8])}"
            f"{', ...' if len(diffs) > 8 else ''})"
            if len(diffs) > 3
            else ""
        )
        shown = "; ".join(
            f"{key} is {_short(a)} in the checkpoint, {_short(b)} in this config"
            for key, a, b in diffs[:3]
        )
        raise ValueError(
            f"checkpoint {path} was made with another config: {shown}{more}; resume with the "
            "config that made it (same models, plan, algo, seed, reward kind and async), or start "
            "a new run (--out-dir DIR, without --resume)"
        )
    for name in meta["files"] if verify_files else ():
        _read_verified(path, name, meta)
        # The content too (pickle-free, as every rank reads it), memory-mapped: no tensor data read.
        _load_safe(os.path.join(path, name), mmap=True)
    return int(meta["step"])


def load(rt, path: str) -> int:
    """Restore this rank's trained shards, optimizer state and RNG; returns the step."""
    state = read_rank_file(path, dist.get_rank())
    for m, eng in rt.models.engines.items():
        if eng is None or eng.optim is None:
            continue
        s = state["models"].get(m)
        if s is None or s["flat"].shape != eng.shard.flat.shape or s["layout"] != str(eng.layout):
            raise ValueError(
                f"checkpoint {path} rank {dist.get_rank()}: no matching {m} shard for {eng.layout}"
            )
        eng.shard.flat.copy_(s["flat"])
        if s["exp_avg"] is not None:
            # The engine builds its Trainer lazily; build it now to restore the moments.
            eng._trainer = eng._trainer or Trainer(eng, eng.optim)
            eng._trainer.exp_avg.copy_(s["exp_avg"])
            eng._trainer.exp_avg_sq.copy_(s["exp_avg_sq"])
            eng._trainer.num_steps = s["num_steps"]
            if s.get("master") is not None:  # bf16 shards: the fp32 master weights
                eng._trainer.master.copy_(s["master"])
        if getattr(eng, "experts", None) is not None:
            e = s.get("experts")
            if e is None or e["flat"].shape != eng.experts.flat.shape:
                raise ValueError(
                    f"checkpoint {path} rank {dist.get_rank()}: no matching {m} expert shard "
                    f"for {eng.layout}"
                )
            eng.experts.flat.copy_(e["flat"])
            if e["exp_avg"] is not None:
                eng._trainer = eng._trainer or Trainer(eng, eng.optim)
                eng._trainer.experts.exp_avg.copy_(e["exp_avg"])
                eng._trainer.experts.exp_avg_sq.copy_(e["exp_avg_sq"])
                if e.get("master") is not None:
                    eng._trainer.experts.master.copy_(e["master"])
    torch.set_rng_state(state["rng"])
    if "kl_coef" in state:  # absent in checkpoints written before adaptive KL existed
        rt.kl_coef = float(state["kl_coef"])
        rt.reward_moments = state["reward_moments"].to(torch.float64).clone()
    if getattr(rt, "astate", None) is not None and "async" in state:
        rt.astate.load_state_dict(
            state["async"], rt.schema, f"checkpoint {path} rank {dist.get_rank()}"
        )
    return int(state["step"])


def _say(line: str) -> None:
    print(line, flush=True)


def resume(rt, path: str, out_dir: str, say=_say) -> int:
    """Collective: every rank loads its part of checkpoint `path` (load); only when every rank
    has, rank 0 cuts out_dir's metrics.jsonl and samples.jsonl back to the checkpoint's step (the
    steps after it run again), then all wait for that cut. If any rank refuses its file, every rank
    raises the same ValueError naming the ranks and their causes, and nothing in out_dir has
    changed. Returns the step. `say` prints rank 0's lines about the cut."""
    from .observe import cut_after

    rank = dist.get_rank()
    try:
        step, err = load(rt, path), None
    except Exception as e:
        step, err = -1, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, (step, err))
    bad = [(r, e) for r, (_, e) in enumerate(results) if e is not None]
    steps = sorted({s for s, e in results if e is None})
    if not bad and len(steps) > 1:
        bad = [
            (r, f"its file holds step {s}") for r, (s, _) in enumerate(results) if s != steps[-1]
        ]
    if bad:
        r, e = bad[0]
        more = f" (and ranks {[b[0] for b in bad[1:]]})" if len(bad) > 1 else ""
        raise ValueError(
            f"--resume {path}: rank {r}{more} could not load its checkpoint: {e}; nothing in "
            f"{out_dir} was changed (metrics.jsonl and samples.jsonl keep every step); resume "
            "from another step"
        )
    if rank == 0:
        for name in ("metrics.jsonl", "samples.jsonl"):
            n = cut_after(os.path.join(out_dir, name), step)
            if n:
                say(f"--resume from step {step}: dropped {n} later records of {name}")
    dist.barrier()  # no rank appends records before rank 0 cut the files
    return step


__all__ = ["save", "load", "resume", "find", "check", "sweep", "read_rank_file"]
