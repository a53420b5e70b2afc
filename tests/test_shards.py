"""Sharded runs (iclab run EXP --executor local|ray): shards as tasks, the shard cache, resume, assembly.

The fast tests use a toy experiment of four shards defined in a user file (so that worker processes can
load it as ``path.py:NAME``): numpy only, its shards log every computation to a file (counted across
processes) and can be told to SIGKILL their process or raise at a given shard. The slow tests run
gating.fig1 and gating.fig2 on small configs, sharded and unsharded, locally and through a real local
Ray head (the fixture of tests/conftest.py), and compare the arrays.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from iclab.cli import main
from iclab.launch import UserError, run_experiment
from iclab.store import Store

TOY_SOURCE = textwrap.dedent('''
    import os
    import signal

    import numpy as np

    from iclab.experiments import Experiment, ExperimentConfig, check_abs, param


    class Config(ExperimentConfig):
        parts: int = param(4, "independent parts (one shard each)", ge=1, le=50)


    def _part(config, i):
        return np.random.default_rng([config.seed, i]).standard_normal(3)


    def run(config, reporter):
        x = np.stack([_part(config, i) for i in range(config.parts)])
        return {"x": x, "total": x.sum()}


    def shards(config):
        return [f"part{i}" for i in range(config.parts)]


    def run_shard(config, name, reporter):
        with open(os.environ["TOY_SHARD_LOG"], "a") as f:
            f.write(name + "\\n")
        if os.environ.get("TOY_SHARD_KILL") == name:
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("TOY_SHARD_RAISE") == name:
            raise KeyboardInterrupt
        if os.environ.get("TOY_SHARD_FAIL") == name:
            raise RuntimeError("injected failure")
        if os.environ.get("TOY_SHARD_DIVERGE") == name:
            from iclab.engines import Diverged

            raise Diverged("toy loop", 7, 0.7, 6, 0.6, 1.5, {"step": np.arange(6.0), "loss": np.ones((1, 6))})
        return {"x": _part(config, int(name[4:]))[None]}


    def assemble(config, parts, reporter):
        x = np.concatenate([parts[name]["x"] for name in shards(config)])
        return {"x": x, "total": x.sum()}


    def checks(config, r):
        return [check_abs("total = sum of the parts", float(r["total"]), float(r["x"].sum()), 1e-12)]


    def plot(config, r):
        from iclab.experiments._plot import figure

        fig, axes = figure()
        axes[0, 0].plot(r["x"].ravel())
        return fig


    TOY = Experiment(id="iclabtest.shardtoy", title="toy", paper="test", reference="none", config=Config,
                     presets={"quick": {}, "paper": {"parts": 8}}, run=run, checks=checks, plot=plot,
                     shards=shards, run_shard=run_shard, assemble=assemble)
''')


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """(reference of the toy experiment, a function returning the shards computed so far, in order)."""
    path = tmp_path / "toy.py"
    path.write_text(TOY_SOURCE)
    log = tmp_path / "shards.log"
    log.write_text("")
    monkeypatch.setenv("TOY_SHARD_LOG", str(log))
    for var in ("TOY_SHARD_KILL", "TOY_SHARD_RAISE", "TOY_SHARD_FAIL", "TOY_SHARD_DIVERGE"):
        monkeypatch.delenv(var, raising=False)
    return f"{path}:TOY", lambda: log.read_text().split()


def _arrays(result) -> dict:
    return {k: np.asarray(v) for k, v in result.arrays.items()}


def test_a_sharded_toy_run_equals_the_unsharded_one_and_records_its_shards(toy, tmp_path):
    ref, computed = toy
    plain = run_experiment(ref, root=tmp_path / "plain")
    assert computed() == []  # the unsharded run is exp.run, not the shards
    sharded = run_experiment(ref, root=tmp_path / "sharded", executor="local", workers=1)
    assert computed() == ["part0", "part1", "part2", "part3"]
    assert sharded.path.name == plain.path.name  # the config hash does not depend on the executor
    for k, v in _arrays(plain).items():
        np.testing.assert_array_equal(_arrays(sharded)[k], v, err_msg=k)  # numpy, same arithmetic: exact
    metrics = json.loads((sharded.path / "metrics.json").read_text())
    assert metrics["sharded"] == {"executor": "local", "shards": 4, "computed": 4, "reused": 0}
    assert "sharded: 4 shards on the local executor (4 computed now, 0 reused" in (sharded.path / "log.txt").read_text()
    assert not Store(tmp_path / "sharded").running_dir("iclabtest.shardtoy", sharded.path.name.rsplit("-", 1)[1]).exists()
    # a stored result is reused whatever the executor: nothing is computed again
    again = run_experiment(ref, root=tmp_path / "plain", executor="local", workers=1)
    assert again.reused and computed() == ["part0", "part1", "part2", "part3"]


def test_an_interrupted_sharded_run_resumes_shard_by_shard(toy, tmp_path, monkeypatch):
    ref, computed = toy
    plain = run_experiment(ref, root=tmp_path / "plain")
    monkeypatch.setenv("TOY_SHARD_RAISE", "part2")  # stands in for Ctrl-C while the third shard computes
    with pytest.raises(KeyboardInterrupt):
        run_experiment(ref, root=tmp_path / "r", executor="local", workers=1)
    assert computed() == ["part0", "part1", "part2"]
    store = Store(tmp_path / "r")
    cached = sorted(p.name for p in store.root.glob(".running/*/shards/*"))
    assert cached == ["part0.json", "part0.npz", "part1.json", "part1.npz"]
    assert [r["status"] for r in store.rows()] == ["interrupted"]
    monkeypatch.delenv("TOY_SHARD_RAISE")
    resumed = run_experiment(ref, root=tmp_path / "r", executor="local", workers=1)
    assert computed() == ["part0", "part1", "part2", "part2", "part3"]  # only the unfinished shards
    for k, v in _arrays(plain).items():
        np.testing.assert_array_equal(_arrays(resumed)[k], v, err_msg=k)
    assert resumed.resumed == ["2 of 4 shards reused from the shard cache of an earlier run"]
    assert json.loads((resumed.path / "metrics.json").read_text())["sharded"]["reused"] == 2


def test_a_damaged_cached_shard_is_computed_again(toy, tmp_path, monkeypatch):
    ref, computed = toy
    monkeypatch.setenv("TOY_SHARD_RAISE", "part3")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(ref, root=tmp_path, executor="local", workers=1)
    npz = next(tmp_path.glob(".running/*/shards/part1.npz"))
    data = bytearray(npz.read_bytes())
    data[-30] ^= 0xFF  # one flipped byte: the size matches, the SHA-256 does not
    npz.write_bytes(bytes(data))
    monkeypatch.delenv("TOY_SHARD_RAISE")
    result = run_experiment(ref, root=tmp_path, executor="local", workers=1)
    assert computed()[4:] == ["part1", "part3"]
    assert result.passed


def test_a_failing_shard_fails_the_run_and_keeps_the_finished_shards(toy, tmp_path, monkeypatch):
    ref, computed = toy
    monkeypatch.setenv("TOY_SHARD_FAIL", "part1")
    with pytest.raises(Exception, match="shard part1 of iclabtest.shardtoy failed: RuntimeError: injected failure"):
        run_experiment(ref, root=tmp_path, executor="local", workers=1)
    store = Store(tmp_path)
    assert [r["status"] for r in store.rows()] == ["failed"]
    assert sorted(p.name for p in tmp_path.glob(".running/*/shards/*.npz")) == ["part0.npz"]


def test_a_diverging_shard_stores_the_run_as_diverged_with_its_finite_records(toy, tmp_path, monkeypatch):
    ref, computed = toy
    monkeypatch.setenv("TOY_SHARD_DIVERGE", "part1")
    result = run_experiment(ref, root=tmp_path, executor="local", workers=1)
    assert result.status == "diverged" and not result.passed
    assert result.diverged["message"].startswith("loss not finite at step 7 in 'shard part1: toy loop'")
    np.testing.assert_array_equal(result.arrays["loss"], np.ones((1, 6)))
    assert [r["status"] for r in Store(tmp_path).rows()] == ["diverged"]


def _cli(*args, capsys):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("args, message", [
    (["linattn.fig1", "--executor", "local"], "error: linattn.fig1 declares no shards: run it without --executor"),
    (["gating.fig1", "--executor", "local", "--workers", "0"], "error: workers must be an integer ≥ 1 (got 0)"),
    (["gating.fig1", "--executor", "dask"], "error: executor must be one of local, ray (got 'dask')"),
    (["gating.fig1", "--workers", "2"], "error: --workers and --address apply to a sharded run"),
    (["gating.fig1", "--executor", "local", "--address", "auto"], "error: --address applies to --executor ray only"),
])
def test_bad_sharding_options_are_one_line_and_exit_2(args, message, tmp_path, capsys):
    rc, out, err = _cli("run", *args, "--out", str(tmp_path), capsys=capsys)
    assert rc == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_python_api_checks_the_options_too(tmp_path):
    with pytest.raises(UserError, match="declares no shards"):
        run_experiment("linattn.fig1", root=tmp_path, executor="ray")


def test_shard_declarations_go_together():
    from iclab.experiments import Experiment, ExperimentConfig, register

    exp = Experiment(id="iclabtest.half", title="t", paper="t", reference="t", config=ExperimentConfig,
                     presets={"quick": {}, "paper": {}}, run=None, checks=None, plot=None, shards=lambda c: ["a"])
    with pytest.raises(ValueError, match="shards, run_shard and assemble go together"):
        register(exp)


def test_the_gating_shards_cover_the_grid_once():
    """Every (panel, n̄) of gating.fig1 and every (depth, n̄) of gating.fig2 lies in exactly one shard."""
    from iclab.experiments import get_experiment
    from iclab.experiments.gating._common import NBAR_BLOCK

    for exp_id, axis, values in (("gating.fig1", "panels", ["a", "b", "c", "d"]), ("gating.fig2", "layers", [1, 2, 3])):
        exp = get_experiment(exp_id)
        config = exp.resolve("paper")
        names = exp.shards(config)
        assert len(names) == len(values) * -(-len(config.n_bars) // NBAR_BLOCK)
        covered = sorted((v, n) for name in names for v, n in _cells(exp_id, config, name))
        assert covered == sorted((v, n) for v in values for n in config.n_bars)
        assert getattr(config, axis) == values


def _cells(exp_id, config, name):
    from iclab.experiments.gating import fig1, fig2

    head, block = (fig1 if exp_id == "gating.fig1" else fig2)._shard_table(config)[name]
    return [(head, n) for n in block]


@pytest.mark.slow
def test_a_sigkilled_sharded_run_resumes_with_the_local_pool(toy, tmp_path):
    """A real kill: the worker computing part2 SIGKILLs itself, the pool breaks, the shard is retried
    (twice) and killed again, and the run fails; a rerun without the kill computes only what is missing."""
    ref, computed = toy
    env = dict(os.environ, TOY_SHARD_KILL="part2", CI="true")
    args = [sys.executable, "-m", "iclab.cli", "run", ref, "--executor", "local", "--workers", "2", "--out", str(tmp_path)]
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    first = computed()
    assert first.count("part2") == 3  # the first try and its 2 retries
    cached = {p.stem for p in tmp_path.glob(".running/*/shards/*.json")}
    assert "part2" not in cached
    env.pop("TOY_SHARD_KILL")
    r = subprocess.run(args + ["--json"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    again = computed()[len(first):]
    assert sorted(again) == sorted({"part0", "part1", "part2", "part3"} - cached)  # each missing shard once
    assert json.loads(r.stdout)["passed"]


# -- gating.fig1 and gating.fig2, sharded against unsharded (slow) ------------------------------------------

# Small configs: fig1 in panels a and d (d with GLA-vector and 3 restarts of the gated models, so shards hold
# different numbers of runs per kind), two n̄ blocks each: 4 shards; fig2 at depths 1 and 2, two blocks: 4 shards.
# The xla backend: the tolerances below were measured with XLA's forms (the CPU's default backend is native).
FIG1_SMALL_SHARDS = {"panels": ["a", "d"], "vector_panels": ["d"], "n_bars": [0, 2, 5, 10], "steps": 200,
                     "record_every": 50, "n_eval": 512, "restricted_steps": 100, "n_match": 64}
FIG2_SMALL_SHARDS = {"n_bars": [0, 4, 8], "layers": [1, 2], "steps": 100, "record_every": 50, "n_eval": 512}
# float64 training: a shard runs the same operations as its part of the joint run on smaller arrays, so XLA
# may group a reduction's sums differently (the batch mean of a loss, a vmapped matmul); such differences
# are ~1e-16 relative per operation. Measured: ≤ 3e-15 on the trained models' risks, ≤ 1.2e-11 on the held-out
# match's standard errors (a difference of nearly equal predictions amplifies the restricted model's ~1e-14).
RTOL_FLOAT64 = 1e-9
# float32 training (the presets' dtype): the same rounding differences at ~1e-7 relative per operation,
# carried through 200 Adam steps into the trained models and their risks; measured ≤ 7e-7 (the control-variate
# SEs, differences of nearly equal errors), well inside 1e-4. Closed forms, Bayes risks and restricted models
# are float64, as above.
RTOL_FLOAT32 = 1e-4


def assert_same_arrays(a: dict, b: dict, rtol: float) -> dict:
    """Same keys, shapes and NaN pattern; finite entries equal to ``rtol`` (relative to the larger of the
    entry and 1e-12 of the array's scale). Returns the worst relative difference per key."""
    assert sorted(a) == sorted(b)
    worst = {}
    for k in a:
        x, y = np.asarray(a[k], dtype=float), np.asarray(b[k], dtype=float)
        assert x.shape == y.shape, k
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg=k)
        m = np.isfinite(x)
        scale = np.maximum(np.abs(x[m]), max(1e-12 * (np.max(np.abs(x[m])) if m.any() else 1.0), np.finfo(float).tiny))
        worst[k] = float(np.max(np.abs(x[m] - y[m]) / scale)) if m.any() else 0.0
        np.testing.assert_allclose(y[m], x[m], rtol=rtol, atol=0, err_msg=k)
    return worst


def xla_run(exp_id: str, overrides: dict, **options):
    """The quick preset of ``exp_id`` with ``overrides`` on the xla backend (:func:`iclab.run_experiment`)."""
    return run_experiment(exp_id, "quick", overrides, backend="xla", **options)


@pytest.fixture(scope="module")
def fig1_unsharded(tmp_path_factory):
    """The unsharded run of FIG1_SMALL_SHARDS in float64 (the reference of the local and resume tests)."""
    return xla_run("gating.fig1", dict(FIG1_SMALL_SHARDS, dtype="float64"),
                          root=tmp_path_factory.mktemp("fig1-unsharded"), checkpoint_every=0)


@pytest.mark.slow
def test_gating_fig1_on_the_local_pool_equals_the_unsharded_run(fig1_unsharded, tmp_path):
    sharded = xla_run("gating.fig1", dict(FIG1_SMALL_SHARDS, dtype="float64"), root=tmp_path,
                             executor="local", workers=2)
    assert sharded.path.name == fig1_unsharded.path.name
    worst = assert_same_arrays(fig1_unsharded.arrays, sharded.arrays, RTOL_FLOAT64)
    print("gating.fig1 float64, local pool: worst relative differences", sorted(worst.items(), key=lambda kv: -kv[1])[:5])
    assert [c["passed"] for c in sharded.checks] == [c["passed"] for c in fig1_unsharded.checks]
    metrics = json.loads((sharded.path / "metrics.json").read_text())
    assert metrics["sharded"] == {"executor": "local", "shards": 4, "computed": 4, "reused": 0}


@pytest.mark.slow
def test_gating_fig1_interrupted_after_two_shards_resumes_with_the_others(fig1_unsharded, tmp_path, monkeypatch):
    from iclab.experiments import get_experiment

    exp = get_experiment("gating.fig1")
    real, calls = exp.run_shard, []

    def counted(config, name, reporter):
        calls.append(name)
        if len(calls) == 3 and stop:
            raise KeyboardInterrupt  # stands in for a kill while the third shard computes
        return real(config, name, reporter)

    monkeypatch.setattr(exp, "run_shard", counted)
    over = dict(FIG1_SMALL_SHARDS, dtype="float64")
    stop = True
    with pytest.raises(KeyboardInterrupt):
        xla_run("gating.fig1", over, root=tmp_path, executor="local", workers=1)
    assert calls == ["a.n0-2", "a.n5-10", "d.n0-2"]
    stop = False
    resumed = xla_run("gating.fig1", over, root=tmp_path, executor="local", workers=1)
    assert calls[3:] == ["d.n0-2", "d.n5-10"]  # only the unfinished shards
    assert resumed.resumed[0] == "2 of 4 shards reused from the shard cache of an earlier run"
    assert_same_arrays(fig1_unsharded.arrays, resumed.arrays, RTOL_FLOAT64)


@pytest.mark.slow
def test_gating_fig2_sharded_equals_the_unsharded_run(tmp_path):
    over = dict(FIG2_SMALL_SHARDS, dtype="float64")
    plain = xla_run("gating.fig2", over, root=tmp_path / "plain", checkpoint_every=0)
    sharded = xla_run("gating.fig2", over, root=tmp_path / "sharded", executor="local", workers=1)
    worst = assert_same_arrays(plain.arrays, sharded.arrays, RTOL_FLOAT64)
    print("gating.fig2 float64: worst relative differences", sorted(worst.items(), key=lambda kv: -kv[1])[:5])
    assert json.loads((sharded.path / "metrics.json").read_text())["sharded"]["shards"] == 4


@pytest.mark.slow
def test_gating_fig1_through_a_local_ray_head_equals_the_unsharded_run(ray_cluster, tmp_path):
    """float32 (the preset's dtype), the sharded run as the CLI runs it, one Ray task per shard."""
    sets = [a for k, v in FIG1_SMALL_SHARDS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = dict(ray_cluster["env"], ICLAB_RESULTS=str(tmp_path / "ray"))
    r = subprocess.run([sys.executable, "-m", "iclab.cli", "run", "gating.fig1", *sets, "--executor", "ray",
                        "--backend", "xla", "--address", "auto", "--workers", "2", "--json"], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode in (0, 1), r.stderr
    res = json.loads(r.stdout)
    plain = xla_run("gating.fig1", FIG1_SMALL_SHARDS, root=tmp_path / "plain", checkpoint_every=0)
    assert plain.path.name == os.path.basename(res["path"])
    with np.load(os.path.join(res["path"], "trajectories.npz")) as z:
        sharded = {k: z[k] for k in z.files}
    worst = assert_same_arrays(plain.arrays, sharded, RTOL_FLOAT32)
    print("gating.fig1 float32, Ray: worst relative differences", sorted(worst.items(), key=lambda kv: -kv[1])[:5])
    metrics = json.loads((Store(tmp_path / "ray").root / os.path.basename(res["path"]) / "metrics.json").read_text())
    assert metrics["sharded"] == {"executor": "ray", "shards": 4, "computed": 4, "reused": 0}


def test_the_drift_fig2_shards_cover_its_models_once():
    """One shard per trained (depth, λ) of drift.fig2, and ``star`` (λ*, the theory and the gradient flow); an
    unknown shard is an error naming the shards."""
    from iclab.experiments import get_experiment
    from iclab.experiments.drift import fig2

    exp = get_experiment("drift.fig2")
    config = exp.resolve("paper")
    names = exp.shards(config)
    assert len(set(names)) == len(names) == len(config.depths) * len(config.lams) + 1 and names[-1] == "star"
    table = dict(zip(names, fig2._members(config)))
    assert sorted(table.values()) == sorted((L, k) for L in config.depths for k in range(len(config.lams)))
    with pytest.raises(ValueError, match="no shard 'L9.lam0.5'.*L1.lam0.8"):
        exp.run_shard(config, "L9.lam0.5", None)


@pytest.mark.slow
def test_drift_fig2_sharded_equals_the_unsharded_run(tmp_path):
    """The quick preset in float64, small: each (depth, λ) model trained alone with its member id, the λ* model
    with the theory and the flow, assembled: the unsharded run's arrays to float64 rounding."""
    over = {"dtype": "float64", "steps": 30, "n_eval": 300, "n_record": 100, "record_every": 10}
    plain = run_experiment("drift.fig2", "quick", over, root=tmp_path / "plain", checkpoint_every=0)
    sharded = run_experiment("drift.fig2", "quick", over, root=tmp_path / "sharded", executor="local", workers=1)
    worst = assert_same_arrays(plain.arrays, sharded.arrays, RTOL_FLOAT64)
    print("drift.fig2 float64: worst relative differences", sorted(worst.items(), key=lambda kv: -kv[1])[:5])
    assert json.loads((sharded.path / "metrics.json").read_text())["sharded"]["shards"] == 5
