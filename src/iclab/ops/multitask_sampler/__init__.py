"""The gating paper's delimited multi-task prompts (eq 19), labels and tokens drawn by a compiled pass.

:mod:`.native`: the labels' reductions in XLA's own lane order (the same bits as the XLA sampler of
:mod:`iclab.tasks.multitask`, its reference), the tokens written in the layer kernels' blocked layout.
"""

from iclab.ops.multitask_sampler.native import block_tokens as multitask_block_tokens
from iclab.ops.multitask_sampler.native import task_normals as multitask_task_normals

__all__ = ["multitask_block_tokens", "multitask_task_normals"]
