"""Experiment.memory: every experiment whose arrays grow with its config declares an upper estimate of its
memory need, the estimate bounds what a run really takes (peak RSS measured in a child process at two sizes of
the field that scales), is not absurdly loose, and refuses an oversized config before anything is computed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from iclab.experiments import all_experiments
from iclab.launch import UserError, resolve_config, run_experiment

# Experiments without a memory estimate, and why their memory is bounded whatever the config: each entry must
# name a registered experiment that declares none (the test below fails on a stale entry).
BOUNDED = {
    # closed forms and Marchenko-Pastur quadratures on n_r ≤ 10 000 points of d̄/L and the I_values list: arrays
    # of O(n_r) numbers (well under a MB each); no Monte Carlo, no training.
    "mhsa.fig7",
}

# The measured growth of peak RSS may exceed the growth of the estimate by this factor: the estimate counts the
# arrays' bytes, while the RSS also holds what the allocator keeps around them (iclab.ops._runtime.malloc keeps freed blocks
# in the heap, so a block freed before a slightly larger one is allocated is not reused; XLA's buffers are
# aligned and padded). Measured growths lie at 0.5-0.7 of the estimate's in the cases below (0.3-0.9 over every
# experiment measured while the estimates were written).
SLACK = 1.25
# ... and the estimate may exceed the measured growth by at most this factor, so that it does not refuse configs a
# machine could run: its copy counts are upper bounds (XLA fuses many of the copies counted), so it is loose by a
# factor 1-4 at these sizes.
LOOSE = 20.0


def test_every_experiment_declares_memory_or_is_bounded():
    """Fast: a new experiment must declare ``memory`` or be added, with its reason, to BOUNDED."""
    experiments = all_experiments()
    missing = sorted(e for e, exp in experiments.items() if exp.memory is None and e not in BOUNDED)
    assert not missing, f"experiments without a memory estimate (declare memory= or add them to BOUNDED): {missing}"
    stale = sorted(e for e in BOUNDED if e not in experiments or experiments[e].memory is not None)
    assert not stale, f"BOUNDED names experiments that are not registered or declare memory: {stale}"


@pytest.mark.parametrize("exp_id", sorted(all_experiments()))
def test_every_estimate_is_bytes_and_a_name_at_both_presets(exp_id):
    exp = all_experiments()[exp_id]
    if exp.memory is None:
        pytest.skip("bounded (BOUNDED)")
    for preset in ("quick", "paper"):
        need, what = exp.memory(exp.resolve(preset))
        assert isinstance(need, float) and math.isfinite(need) and need > 0, (preset, need)
        assert isinstance(what, str) and what.strip(), (preset, what)
        if exp.preflight is None:  # (an experiment that reads outside files sizes itself from them)
            # every preset must run on a machine of 23 GiB: its 80 % limit must admit them
            assert need < 18 * 2**30, (preset, need / 2**30, what)


def test_an_oversized_config_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """linattn.fig3 at P = 10⁶, N = 10⁵ (within both fields' bounds) needs terabytes for one seed's prompts: the
    estimate refuses it before anything is computed or stored, instead of XLA failing to allocate inside the run."""
    exp, config = resolve_config("linattn.fig3", "quick")
    computed = []
    monkeypatch.setattr(exp, "run", lambda *a, **k: computed.append(1) or {})
    with pytest.raises(UserError):
        resolve_config("linattn.fig3", "quick", {"P": 1_000_000, "N": 100_000})
    with pytest.raises(UserError):
        run_experiment("linattn.fig3", "quick", {"P": 1_000_000, "N": 100_000}, root=tmp_path / "r")
    assert not computed
    assert not (tmp_path / "r").exists()  # nothing stored
    # the estimate, not a validation bound, refuses it: the same config under a large enough limit resolves
    big = exp.memory(config.model_copy(update={"P": 1_000_000, "N": 100_000}))[0]
    monkeypatch.setenv("ICLAB_MEMORY_LIMIT_GB", str(2 * big / 2**30))
    resolve_config("linattn.fig3", "quick", {"P": 1_000_000, "N": 100_000})


# -- the estimates against measured peak RSS ---------------------------------------------------------------------

# The child's own high-water mark: /proc/self/status's VmHWM belongs to the process's address space, new at exec.
# (getrusage's ru_maxrss is not: Linux carries the parent's peak across fork and exec into the child's, so a child
# of a large pytest worker would report the worker's size.)
_CHILD = """
import json, resource, sys
import iclab
exp_id, preset, overrides, root, backend = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
iclab.run_experiment(exp_id, preset, overrides, root=root, force=True, backend=backend)
try:
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
except (OSError, StopIteration):  # not Linux: ru_maxrss, bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
print(json.dumps({"peak": peak}))
"""


def _peak_rss(exp_id: str, preset: str, overrides: dict, root, env: dict, backend: str) -> int:
    """Peak RSS (bytes) of a fresh process that runs the experiment (stored under ``root``) with this backend."""
    r = subprocess.run([sys.executable, "-c", _CHILD, exp_id, preset, json.dumps(overrides), str(root), backend],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["peak"]


# (experiment, preset, settings shared by both runs, the field that scales, its small and large values). Sizes:
# the large run's estimated growth is 0.5-2 GB, far above the few tens of MB by which a process's baseline RSS
# varies, and every run takes seconds besides its compilation. Every run computes with the XLA backend, whose
# batches and saved activations are what the estimates count (under the native backend drift.fig1's one-layer
# models read their batch in a shared layout without saved residuals: its growth from batch 250 to 5000 is below
# the baseline's noise, so there is nothing to bound; the estimate stays the XLA path's, an upper bound).
MEASURED = [
    pytest.param("linattn.fig3", "quick", {"seeds": 1, "steps": 64, "record_every": 8, "population_beside": False},
                 "P", 100_000, 600_000, id="linattn.fig3-P"),
    pytest.param("drift.fig1", "quick", {"steps": 4, "record_every": 2, "n_eval": 100, "n_match": 100,
                                         "lams": [0.8, 0.9, 1.0], "test_ms": [10], "lam_bars": [0.8, 0.9]},
                 "batch", 250, 5000, id="drift.fig1-batch"),
    pytest.param("gating.fig1", "quick", {"steps": 2, "record_every": 1, "n_eval": 200, "restricted": False,
                                          "n_match": 64},
                 "batch", 256, 8192, id="gating.fig1-batch"),
    pytest.param("mhsa.fig1", "quick", {"steps": 2, "record_every": 1, "eval_prompts": 1024},
                 "batch", 512, 8192, id="mhsa.fig1-batch"),
    pytest.param("mhsa.fig6", "quick", {"mc_samples": 500, "r_mc": [1.0]}, "L", 10_000, 150_000, id="mhsa.fig6-L"),
]


@pytest.mark.slow
@pytest.mark.parametrize("exp_id,preset,common,field,small,large", MEASURED)
def test_estimate_bounds_the_measured_growth(exp_id, preset, common, field, small, large, tmp_path, jax_cache):
    """Peak RSS at the large size minus at the small one is at most SLACK × the estimates' difference, and that
    difference at most LOOSE × the measured growth (both runs in fresh processes, so a baseline cancels)."""
    env = dict(os.environ, **jax_cache)
    exp = all_experiments()[exp_id]
    est = {}
    peak = {}
    from iclab.ops import use_backend

    for size in (small, large):
        overrides = {**common, field: size}
        with use_backend("xla"):  # the estimate of the path the child runs
            _, config = resolve_config(exp_id, preset, overrides)
            est[size] = exp.memory(config)[0]
        peak[size] = _peak_rss(exp_id, preset, overrides, tmp_path / str(size), env, "xla")
    growth, d_est = peak[large] - peak[small], est[large] - est[small]
    mib = {k: {size: v / 2**20 for size, v in d.items()} for k, d in (("peak", peak), ("est", est))}
    report = (f"{exp_id}, {field} {small} → {large}: peak RSS {mib['peak'][small]:.0f} → {mib['peak'][large]:.0f} MiB "
              f"(growth {growth / 2**20:.0f} MiB), estimate {mib['est'][small]:.0f} → {mib['est'][large]:.0f} MiB "
              f"(growth {d_est / 2**20:.0f} MiB)")
    print(report)  # shown with pytest -s: the measured growth beside the estimate's
    assert d_est > 0, report
    assert growth <= SLACK * d_est, "the estimate is below the measured need: " + report
    assert d_est <= LOOSE * max(growth, 1), "the estimate is absurdly loose: " + report
