"""Thread pools per process (iclab.threads): ICLAB_THREADS, --threads, and what sweep workers get."""

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from iclab import threads
from iclab.errors import ConfigError
from iclab.cli import main


def cli(*args):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_requested_threads_reads_iclab_threads(monkeypatch):
    monkeypatch.delenv("ICLAB_THREADS", raising=False)
    assert threads.requested_threads() is None and threads.thread_count() == threads.available_cores()
    monkeypatch.setenv("ICLAB_THREADS", "3")
    assert threads.requested_threads() == 3 and threads.thread_count() == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("ICLAB_THREADS", bad)
        with pytest.raises(ConfigError, match="ICLAB_THREADS must be an integer ≥ 1"):
            threads.requested_threads()


def test_set_threads_sizes_every_pool_variable(monkeypatch):
    import jax.numpy as jnp

    # set_threads resizes this process's loaded BLAS/OpenMP pools too: give them back their sizes afterwards
    monkeypatch.setattr(threads, "_limit_loaded_pools", lambda n, user_api=None: None)

    float(jnp.ones(2).sum())  # XLA's client has started in this process
    for name in ("ICLAB_THREADS",) + threads.POOL_VARIABLES:
        monkeypatch.setenv(name, "7")  # restored by monkeypatch afterwards
    with pytest.warns(UserWarning, match="thread pools keep their size"):
        threads.set_threads(1)
    assert all(os.environ[name] == "1" for name in ("ICLAB_THREADS",) + threads.POOL_VARIABLES)
    with pytest.raises(ValueError):
        threads.set_threads(0)


def test_iclab_threads_is_applied_at_import_before_xla_starts():
    code = ("import os, iclab, jax.numpy as jnp; float(jnp.ones(3).sum()); "
            "print(os.environ['PJRT_NPROC'], os.environ['OMP_NUM_THREADS'], len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k not in threads.POOL_VARIABLES}
    one = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, ICLAB_THREADS="1"))
    assert one.returncode == 0, one.stderr
    pjrt, omp, n_one = one.stdout.split()
    assert (pjrt, omp) == ("1", "1")
    four = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, ICLAB_THREADS="4"))
    assert four.returncode == 0, four.stderr
    assert int(four.stdout.split()[2]) > int(n_one)  # XLA's pools really are sized by it


_BLAS_THREADS = ("import {first}; import iclab, numpy, threadpoolctl{extra}; "
                 "print(max(p['num_threads'] for p in threadpoolctl.threadpool_info() if p['user_api'] == 'blas'))")


def _blas_threads(env_extra: dict, first: str = "os", extra: str = "") -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("ICLAB_THREADS",) + threads.POOL_VARIABLES + threads.BLAS_VARIABLES}
    r = subprocess.run([sys.executable, "-c", _BLAS_THREADS.format(first=first, extra=extra)], capture_output=True,
                       text=True, env=dict(env, **env_extra))
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(threads.available_cores() < 2, reason="needs 2 cores to tell one BLAS thread from a pool")
def test_blas_gets_one_thread_unless_asked_for_more():
    # iclab's BLAS work is small: a second thread only spins (module docstring of iclab.threads)
    assert _blas_threads({}) == 1
    assert _blas_threads({"OPENBLAS_NUM_THREADS": "2"}) == 2  # the user's own variable wins
    assert _blas_threads({"ICLAB_THREADS": "2"}) == 2
    # numpy loaded before iclab (a notebook) keeps its pool; set_threads resizes it
    assert _blas_threads({}, first="numpy") >= 2
    assert _blas_threads({}, first="numpy", extra="; iclab.threads.set_threads(1)") == 1


def test_bad_thread_options_are_one_line_exit_2(tmp_path, monkeypatch):
    rc, _, err = cli("run", "linattn.fig1", "--threads", "0", "--out", tmp_path)
    assert rc == 2 and err.count("\n") == 1 and "--threads must be ≥ 1" in err
    rc, _, err = cli("sweep", "linattn.fig1", "--grid", "N=3,4", "--threads", "-1", "--out", tmp_path)
    assert rc == 2 and "--threads must be ≥ 1" in err
    monkeypatch.setenv("ICLAB_THREADS", "many")
    rc, _, err = cli("run", "linattn.fig1", "--out", tmp_path)
    assert rc == 2 and err.count("\n") == 1 and "ICLAB_THREADS must be an integer" in err
    assert not any(tmp_path.iterdir())


PROBE = textwrap.dedent('''
    """Records the thread settings of the process that computes it."""
    import os

    import numpy as np

    from iclab.experiments import Experiment, ExperimentConfig, check_equal, param


    class Config(ExperimentConfig):
        x: int = param(0, "a grid coordinate", ge=0, le=100)


    def run(config, reporter):
        return {"pjrt": np.array(int(os.environ["PJRT_NPROC"])), "omp": np.array(int(os.environ["OMP_NUM_THREADS"])),
                "pid": np.array(os.getpid())}


    def plot(config, arrays):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt.figure()


    probe = Experiment(id="user.thread-probe", title="thread probe", paper="user", reference="none", config=Config,
                       presets={"quick": {}, "paper": {}}, run=run, checks=lambda c, a: [check_equal("ran", 1, 1)],
                       plot=plot)
''')


@pytest.mark.slow  # spawns a pool of fresh worker processes (~10-20 s)
def test_local_sweep_workers_share_the_cores_out(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    cores = threads.available_cores()
    env = {k: v for k, v in os.environ.items() if k not in ("ICLAB_THREADS",) + threads.POOL_VARIABLES}
    base = [sys.executable, "-m", "iclab.cli", "sweep", f"{probe}:probe", "--grid", "x=1,2,3,4", "--json"]
    for extra, expected in (([ "--workers", "2"], max(1, cores // 2)), (["--workers", "2", "--threads", "3"], 3)):
        root = tmp_path / f"r{len(extra)}"
        r = subprocess.run(base + extra + ["--out", str(root)], capture_output=True, text=True,
                           env=dict(env, CI="true"), timeout=600)
        assert r.returncode == 0, r.stderr
        points = json.loads(r.stdout)["points"]
        arrays = [np.load(os.path.join(p["path"], "trajectories.npz")) for p in points]
        assert {int(a["pjrt"]) for a in arrays} == {expected} and {int(a["omp"]) for a in arrays} == {expected}
        assert len({int(a["pid"]) for a in arrays}) >= 2  # computed by the pool's workers, not the driver


def test_run_split_covers_every_job_once_on_a_kept_pool():
    from iclab.ops._runtime.threads import _kernel_pool, run_split

    for jobs, threads in ((1, 3), (7, 1), (7, 2), (7, 3), (2, 5)):
        seen = np.zeros(jobs, int)

        def kernel(out, first, stop):
            out[first:stop] += 1

        run_split(kernel, jobs, seen, threads=threads)
        assert seen.tolist() == [1] * jobs
    assert _kernel_pool(2) is _kernel_pool(2)  # one pool per size for the process


def test_run_split_raises_after_every_run_has_finished():
    import threading
    import time

    from iclab.ops._runtime.threads import run_split

    done = []

    def kernel(first, stop):
        if first == 0:  # the pool's run: slow, then done
            time.sleep(0.2)
            done.append(threading.current_thread().name)
        else:  # the calling thread's run fails at once
            raise RuntimeError("bad block")

    with pytest.raises(RuntimeError, match="bad block"):
        run_split(kernel, 2, threads=2)
    assert len(done) == 1  # the other run finished before the error reached the caller

    def failing_pool_run(first, stop):
        if first == 0:
            raise ValueError("pool run")

    with pytest.raises(ValueError, match="pool run"):
        run_split(failing_pool_run, 2, threads=2)


def test_run_split_from_several_threads_at_once():
    import concurrent.futures

    from iclab.ops._runtime.threads import run_split

    def square(x, out, first, stop):
        out[first:stop] = x[first:stop] ** 2

    def one(seed):
        x = np.random.default_rng(seed).standard_normal(1000)
        out = np.empty_like(x)
        run_split(square, x.size, x, out, threads=3)
        return np.array_equal(out, x ** 2)

    with concurrent.futures.ThreadPoolExecutor(4) as callers:
        assert all(callers.map(one, range(16)))


_MXCSR_TEST_IR = """
declare void @llvm.x86.sse.ldmxcsr(ptr)
declare void @llvm.x86.sse.stmxcsr(ptr)
define i32 @get() {
entry:
  %p = alloca i32
  call void @llvm.x86.sse.stmxcsr(ptr %p)
  %v = load i32, ptr %p
  ret i32 %v
}
define void @set(i32 %v) {
entry:
  %p = alloca i32
  store i32 %v, ptr %p
  call void @llvm.x86.sse.ldmxcsr(ptr %p)
  ret void
}
define void @mul(ptr noalias %a, ptr noalias %b, ptr noalias %out, i64 %first, i64 %stop) {
entry:
  br label %head
head:
  %i = phi i64 [%first, %entry], [%next, %body]
  %c = icmp slt i64 %i, %stop
  br i1 %c, label %body, label %done
body:
  %pa = getelementptr float, ptr %a, i64 %i
  %pb = getelementptr float, ptr %b, i64 %i
  %po = getelementptr float, ptr %out, i64 %i
  %x = load float, ptr %pa
  %y = load float, ptr %pb
  %r = fmul float %x, %y
  store float %r, ptr %po
  %next = add i64 %i, 1
  br label %head
done:
  ret void
}
"""


@pytest.mark.skipif(__import__("platform").machine().lower() not in ("x86_64", "amd64"), reason="MXCSR is x86-64's")
def test_run_split_flushes_denormals_on_every_thread_and_restores_the_callers_mode():
    """Subnormal float32 results (FTZ) and operands (DAZ) are zero inside run_split on every thread, whatever the
    caller's mode (here a thread's default: subnormals kept), and the caller's mode is back afterwards."""
    import ctypes

    from iclab.ops._runtime.llvm import compile_function
    from iclab.ops._runtime.threads import run_split

    P, I = ctypes.c_void_p, ctypes.c_int64
    get = compile_function(_MXCSR_TEST_IR, "get", ctypes.c_uint32, ())
    set_ = compile_function(_MXCSR_TEST_IR, "set", None, (ctypes.c_uint32,))
    mul = compile_function(_MXCSR_TEST_IR, "mul", None, (P, P, P, I, I))
    flags = 0x8040  # FTZ, DAZ
    saved = get()
    set_(saved & ~flags)
    try:
        n = 64
        cases = {"subnormal product (FTZ)": (np.full(n, 1e-20, np.float32), np.full(n, 1e-20, np.float32)),
                 "subnormal operand (DAZ)": (np.full(n, 1e-39, np.float32), np.full(n, 1e10, np.float32))}
        for name, (a, b) in cases.items():
            out = np.empty(n, np.float32)
            mul(a.ctypes.data, b.ctypes.data, out.ctypes.data, 0, n)
            assert np.all(out != 0), name  # this thread's default mode keeps them
            for threads in (1, 2, 3):
                out[:] = 1
                run_split(lambda first, stop: mul(a.ctypes.data, b.ctypes.data, out.ctypes.data, first, stop), n,
                          threads=threads)
                assert not out.any(), (name, threads)
            assert get() & flags == 0  # the caller's mode restored
        set_(saved | flags)  # a caller in XLA's mode keeps it
        run_split(lambda first, stop: None, 2, threads=2)
        assert get() & flags == flags
    finally:
        set_(saved)
