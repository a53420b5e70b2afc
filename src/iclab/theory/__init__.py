"""Closed-form theory, one module per paper; nothing here trains a model.

- :mod:`iclab.theory.linattn`: linear attention training dynamics (Zhang, Singh, Latham, Saxe).
- :mod:`iclab.theory.wpgd`: gated linear attention as weighted preconditioned GD (gating).
- :mod:`iclab.theory.drift`: GLA with a forget factor under AR(1) task drift (drift).
"""

from iclab.theory import drift, linattn, wpgd

__all__ = ["drift", "linattn", "wpgd"]
