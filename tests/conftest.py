import os
import struct
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# MLX's CUDA backend runs float32 matmuls in TF32 (relative error 3e-4 on an H200, 2e-7 with
# this set); the exactness oracles compare float32 logits at 1e-4.
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# OpenBLAS must be loaded before mlx; load kvfn/blas.py by path so that kvfn and kvfn_models are
# imported first by the tests, under typeguard's import hook.
_spec = importlib.util.spec_from_file_location(
    "_kvfn_blas", Path(__file__).parents[1] / "kvfn/blas.py"
)
_blas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_blas)
_blas.use_openblas()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct, dequantized (the CPU default)."""
    import kvfn_models as models

    return models.load()


def write_gguf(path: Path, metadata: dict, tensors: dict[str, int]) -> Path:
    """A GGUF v3 header with the given metadata and tensor infos (name -> type id), no data."""

    def string(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    def value(v) -> bytes:
        if isinstance(v, str):
            return struct.pack("<I", 8) + string(v)
        if isinstance(v, bool):
            return struct.pack("<I?", 7, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v)
        if isinstance(v, float):
            return struct.pack("<If", 6, v)
        raise TypeError(v)

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, v in metadata.items():
        out += string(k) + value(v)
    for name, kind in tensors.items():
        out += string(name) + struct.pack("<IQQIQ", 2, 4, 4, kind, 0)
    path.write_bytes(out)
    return path
