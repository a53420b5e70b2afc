"""iclab: a laboratory for the theory of in-context learning in attention models.

Importing iclab turns on float64 in JAX: theory and the exact engines need it, and a
sampled engine that wants float32 asks for it explicitly.
"""

import jax

jax.config.update("jax_enable_x64", True)

__version__ = "0.1.0"
