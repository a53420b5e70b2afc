"""Models: pure functions (params, prompts) -> ŷ, one module per architecture, and the family registry.

- :mod:`iclab.models.linattn`: linear (and softmax) attention ATTN_M, ATTN_S and the cubic-feature
  MLP of the linattn paper, reduced and full-matrix forms.
- :mod:`iclab.models.gla`: gated linear attention on delimited multi-task prompts (gating).
- :mod:`iclab.models.gla_forget`: GLA with a forget factor λ on drifting-task prompts (drift).
- :mod:`iclab.models.mhsa`: multi-head softmax attention and its spectral (decomposable) form (mhsa).
- :mod:`iclab.models.transformer`: a GPT-2-style transformer over (x, y) tokens (Garg et al. 2022), beside
  the theory models: one family per task (``transformer``, ``transformer_multitask``, ``transformer_drift``,
  ``transformer_multitask_regression``), each reading its task's batch.
- :mod:`iclab.models.gpt2_gla`: GPT-2 with (gated) linear attention (torch; the ``llm`` extra).

A model family (:class:`ModelFamily`) bundles a module's init, prediction and reduced forms behind one
protocol; :func:`register_model` makes it usable by every engine that accepts its task.
"""

from iclab.models._family import (
    ModelFamily,
    check_reduced_forms,
    get_model,
    model_families,
    register_model,
    unregister_model,
)
from iclab.models import gla, linattn, transformer  # noqa: E402,F401  (the built-in families register on import)

__all__ = ["ModelFamily", "check_reduced_forms", "get_model", "model_families", "register_model", "unregister_model"]
