"""compile_kernels: a generated kernel is compiled once per machine and loaded from the cache by later
processes (whatever their hash seed), and gives the numbers of an in-memory compilation."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
import numpy as np
from iclab.ops._runtime.numba_cache import compile_kernels

SOURCE = '''
def scale(x):
    return x * K

def kernel(a, out):
    for i in range(a.shape[0]):
        out[i] = scale(a[i]) + F(1.5)
'''
scale, kernel = compile_kernels(SOURCE, ["scale", "kernel"], label="test kernel", constants={"K": 3, "F": np.float32},
                                fastmath={"reassoc", "contract", "nsz", "arcp"}, nogil=True)
a = np.arange(5, dtype=np.float64)
out = np.empty_like(a)
kernel(a, out)
print(json.dumps({"out": out.tolist(), "hits": sum(kernel.stats.cache_hits.values()),
                  "misses": sum(kernel.stats.cache_misses.values())}))
"""


def _run(cache, seed):
    env = dict(os.environ, ICLAB_KERNEL_CACHE=str(cache), PYTHONHASHSEED=str(seed))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_kernel_compiles_once_and_later_processes_load_it(tmp_path):
    first = _run(tmp_path / "cache", seed=1)
    second = _run(tmp_path / "cache", seed=2)  # another hash seed: another order of the fastmath set's repr
    expected = [3.0 * i + 1.5 for i in range(5)]
    assert first["out"] == second["out"] == expected
    assert (first["hits"], first["misses"]) == (0, 1)
    assert (second["hits"], second["misses"]) == (1, 0)
    assert len(list((tmp_path / "cache").glob("k_*.py"))) == 1


def test_without_a_cache_the_kernel_compiles_in_memory(tmp_path):
    off = _run("off", seed=0)
    assert off["out"] == [3.0 * i + 1.5 for i in range(5)] and off["hits"] == 0


def test_a_damaged_cached_source_is_written_again(tmp_path):
    cache = tmp_path / "cache"
    first = _run(cache, seed=0)
    (path,) = cache.glob("k_*.py")
    path.write_text("def kernel(:\n")  # damaged: not even Python
    again = _run(cache, seed=0)
    assert again["out"] == first["out"] and "def kernel(a, out):" in path.read_text()


def test_damaged_machine_code_in_the_cache_is_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    first = _run(cache, seed=0)
    damaged = list((cache / "__pycache__").glob("k_*.nb[ic]"))
    assert damaged
    for path in damaged:
        path.write_bytes(b"garbage")  # numba itself would raise reading these
    again = _run(cache, seed=0)
    assert again["out"] == first["out"] and again["misses"] == 1
    assert _run(cache, seed=0)["hits"] == 1  # and cached again
