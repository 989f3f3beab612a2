# Checks the hardware calibration (real_py/calibrate): the line and pipe-wait fits by hand, the cpu
# profile measured on gloo ranks and cached, calibrate_gpu's dry run on the processor, job-shaped
# setups; a failure points to real_py/calibrate/measure.py (timings), fit.py (fits), setup.py
# (Setup) or profiles.py (cache, resolve_profile).
import pytest

from real_py.search import Workload

pytestmark = pytest.mark.timeout(300)


def test_calibration_line_fit():
    from real_py.calibrate.fit import _fit_line

    assert _fit_line({1: 3.0, 3: 7.0, 5: 11.0}) == pytest.approx((2.0, 1.0))
    assert _fit_line({1: 3.0, 5: 12.2}) == pytest.approx((2.3, 0.7))
    assert _fit_line({1: 3.0, 2: 4.0, 5: 12.2})[0] == pytest.approx(2.4)


def test_pipe_wait_fit_by_hand():
    """Pipelines side by side against half as many: the extra seconds of an inference pass and of
    a decode step (two messages between the stages each), per message, their mean; >= 0; absent
    timings (older calibrations) give 0."""
    from real_py.calibrate.fit import _pipe_wait

    raw = {
        "pp2_inf_4": 2.0,
        "pp2busy_inf_4": 3.0,
        "pp2_gen2_4": 1.0,
        "pp2_gen10_4": 9.0,
        "pp2busy_gen2_4": 2.0,
        "pp2busy_gen10_4": 18.0,
    }
    # inference +1.0 s, decode step (18 - 2) / 8 - (9 - 1) / 8 = +1.0 s: 1.0 / 2 per message
    assert _pipe_wait(raw) == pytest.approx(0.5)
    assert _pipe_wait(raw | {"pp2busy_gen10_4": 10.0}) == pytest.approx((1.0 + 0.0) / 2 / 2)
    assert _pipe_wait(raw | {"pp2busy_inf_4": 1.0, "pp2busy_gen10_4": 6.0}) == 0.0
    assert _pipe_wait(raw | {"pp2busy_gen10_4": 1.0}) == pytest.approx(
        0.5
    )  # busy step <= 0: left out
    assert _pipe_wait(raw | {"pp2busy_inf_4": 20.0}) == 2.0  # capped at one uncontended pass
    assert _pipe_wait({k: v for k, v in raw.items() if "busy" not in k}) == 0.0


@pytest.mark.dist
def test_cpu_profile_calibrates_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("REAL_PY_CACHE", str(tmp_path))
    from real_py.calibrate import cpu_profile, resolve_profile

    p = cpu_profile(refresh=True, reps=3, repeats=2)
    assert p.name == "cpu" and p.peak_flops > 1e8 and p.hbm_bw > 1e8 and p.intra_bw > 1e7
    # the recorded raw calibrations refit to the same profile (bench_estimator --rescore --refit)
    import json

    from real_py.calibrate import profile_from_raw
    from real_py.calibrate.profiles import _cache_path

    with open(_cache_path()) as f:
        raws = json.load(f)["measured"]["repeats"]
    assert len(raws) == 2 and profile_from_raw(raws) == p
    assert 0 < p.intra_lat < 0.1 and 0 < p.p2p_lat_ratio < 100 and p.shared_cores >= 2
    assert 0 <= p.pipe_wait_lat < 0.1
    # Running a 5-layer engine always costs host time; a slope or an intercept alone can fit to
    # 0 (clamped) when the machine is busy during the 3 quick repetitions.
    for layer, fixed in (
        (p.layer_lat, p.head_lat),
        (p.train_layer_lat, p.train_lat),
        (p.decode_layer_lat, p.decode_lat),
    ):
        assert layer >= 0 and fixed >= 0 and 0 < 5 * layer + fixed < 0.5
    assert (tmp_path / "cpu_profile.json").exists()
    assert resolve_profile("cpu") == p  # read back from the cache file
    import json

    runs = json.loads((tmp_path / "cpu_profile.json").read_text())["measured"]["repeats"]
    assert len(runs) == 2 and all("allreduce_world_s" in r for r in runs)


@pytest.mark.dist
def test_calibrate_gpu_keeps_the_datasheet_and_measures_launch_costs():
    """calibrate_gpu on the processor (its dry run; the H200 run is bench/bench_gpu_ppo.py): the
    datasheet fields stay, the per-layer / per-pass fields are measured, bad arguments are
    refused."""
    from real_py.calibrate import calibrate_gpu
    from real_py.search.hardware import PROFILES

    p, raw = calibrate_gpu("h100", reps=2, repeats=1, device="cpu")
    base = PROFILES["h100"]
    assert (
        p.name == "h100_cal" and len(raw["repeats"]) == 1 and raw["repeats"][0]["device"] == "cpu"
    )
    for f in (
        "peak_flops",
        "flops_eff",
        "hbm_bw",
        "intra_bw",
        "inter_bw",
        "intra_lat",
        "mem_bytes",
    ):
        assert getattr(p, f) == getattr(base, f), f
    for layer, fixed in (
        (p.layer_lat, p.head_lat),
        (p.train_layer_lat, p.train_lat),
        (p.decode_layer_lat, p.decode_lat),
    ):
        assert layer >= 0 and fixed >= 0 and 0 < 5 * layer + fixed < 0.5
    with pytest.raises(ValueError, match=r"base='v100'; allowed"):
        calibrate_gpu("v100")
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        calibrate_gpu("h200", repeats=0)


@pytest.mark.dist
def test_calibration_on_the_jobs_own_shape(tmp_path, monkeypatch):
    """Setup.for_job carries a job's model shape and pass sizes into the calibration engines, and
    the cached profile is keyed by its setup (a profile of another setup is measured again)."""
    monkeypatch.setenv("REAL_PY_CACHE", str(tmp_path))
    import json
    from dataclasses import asdict

    from real_py.calibrate import DEFAULT, Setup, cpu_profile
    from real_py.rlhf import config as CF

    actor = CF.from_dict({}).model_configs()["actor"]
    job = Setup.for_job(actor, batch_rows=8, train_rows=4, seq=20, prompt=8)
    assert (job.hidden_size, job.num_key_value_heads, job.vocab_size) == (
        actor.hidden_size,
        actor.num_key_value_heads,
        actor.vocab_size,
    )
    assert job.config(5, "value").num_hidden_layers == 5 and job.config(1).head == "lm"
    # for_workload: one replica's passes as the runtime runs them (a train pass is one micro-batch)
    wl = Workload(batch_size=16, prompt_len=8, gen_len=12, ppo_minibatches=2, micro_batches=2)
    assert Setup.for_workload(actor, wl) == Setup.for_job(
        actor, batch_rows=16, train_rows=4, seq=20, prompt=8
    )
    assert job.dtype == actor.dtype
    p = cpu_profile(refresh=True, reps=2, repeats=1, setup=job)
    saved = json.loads((tmp_path / "cpu_profile.json").read_text())
    assert saved["setup"] == asdict(job) and saved["measured"]["setup"] == asdict(job)
    assert cpu_profile(reps=2, repeats=1, setup=job) == p  # same setup: the cache
    cpu_profile(reps=2, repeats=1, setup=DEFAULT)  # another setup: measured again
    assert json.loads((tmp_path / "cpu_profile.json").read_text())["setup"] == asdict(DEFAULT)
    with pytest.raises(ValueError, match=r"need 1 <= prompt \(20\) < seq \(20\)"):
        Setup.for_job(actor, batch_rows=8, train_rows=4, seq=20, prompt=20)
