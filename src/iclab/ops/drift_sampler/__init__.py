"""The drift paper's prompts under AR(1) task drift, w_i = γ w_{i−1} + e_i, drawn by a compiled sampler.

:mod:`.native`: counter-based (Philox) words turned into normals by a ziggurat or Box-Muller (``_ir``, one
LLVM IR kernel over lanes of prompts), the tokens and targets written in the layouts the layer kernels read.
Its scalar twin (``kernel_reference`` in :mod:`.native`) is the reference its vectorised form is tested
against; the pure-JAX sampler of another generator is :func:`iclab.tasks.drift.sample_drift_prompts`.
"""

from iclab.ops.drift_sampler.native import NORMALS as DRIFT_NORMALS
from iclab.ops.drift_sampler.native import sample_shared_batch as drift_shared_batch
from iclab.ops.drift_sampler.native import sample_training_batch as drift_training_batch

__all__ = ["DRIFT_NORMALS", "drift_shared_batch", "drift_training_batch"]
