"""kvfn: functional, opt-in KV-cache eviction for MLX and mlx-lm models."""

from .blas import use_openblas

use_openblas()  # before mlx.core is imported anywhere below

__version__ = "0.1.0"
