"""Model loading for kvfn: the embedded SmolLM2, llama-family GGUF files, mlx-lm folders.

``kvfn_models.ship`` moves a model to a machine without a registry: an mlx-lm folder in chunks.
"""

from kvfn.blas import use_openblas

use_openblas()  # before mlx.core is imported anywhere below

from .gguf import GGUFError, read_header  # noqa: E402
from .load import embedded_model_path, load, load_gguf, model_path  # noqa: E402

__all__ = ["GGUFError", "embedded_model_path", "load", "load_gguf", "model_path", "read_header"]
