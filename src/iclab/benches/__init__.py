"""Benchmarks: the fast paths and their references timed side by side in one run (``iclab bench NAME``).

One module per paper (:mod:`.linattn`, :mod:`.gating`, :mod:`.drift`, :mod:`.mhsa`) and one for sharing a
machine (:mod:`.sweep`); :mod:`._roofline` counts a step's flops and measures the matmul peak beside it, so
that a step is reported as a multiple of its arithmetic floor. They sit above the experiments (they time
the experiments' own steps) and may reach the kernels of :mod:`iclab.ops` directly.
"""
