"""Read a GGUF file's header: metadata, tensor types, shapes and offsets, without tensor data.

Enough to validate a file (magic, architecture, tensor types) and give a clear error before
``mx.load`` reads the tensors.
"""

import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = b"GGUF"
TENSOR_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0"}
TENSOR_TYPES.update({10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"})
# Weights per block of each block-quantized type: a tensor's rows must hold whole blocks.
BLOCK_WEIGHTS = {t: 32 for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}
BLOCK_WEIGHTS.update({t: 256 for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")})
# Value types of GGUF metadata: struct format per scalar type; 8 = string, 9 = array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


class GGUFError(ValueError):
    """A file that is not a readable GGUF model, or one kvfn cannot load."""


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict
    tensor_types: dict  # tensor name -> type name ("Q4_1", "F32", ...)
    tensor_shapes: dict = field(default_factory=dict)  # name -> GGML dims, row length first
    tensor_offsets: dict = field(default_factory=dict)  # name -> bytes after data_start
    data_start: int = 0  # the tensor data's first byte in the file

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "<none>")


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind == 9:
            item_kind, n = self.take("I"), self.take("Q")
            return [self.value(item_kind) for _ in range(n)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata type {kind}")


def read_header(path: str | Path, max_bytes: int = 64 << 20) -> GGUFHeader:
    """Parse the header of a GGUF file (metadata + tensor infos)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such model file: {path}")
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no 'GGUF' magic at its start)")
        f.seek(0)
        data = f.read(max_bytes)
    r = _Reader(data, path)
    r.pos = 4
    version = r.take("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    metadata = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.take("I"))
    tensor_types, tensor_shapes, tensor_offsets = {}, {}, {}
    for _ in range(n_tensors):
        name = r.string()
        tensor_shapes[name] = tuple(r.take("Q") for _ in range(r.take("I")))
        kind = r.take("I")
        tensor_offsets[name] = r.take("Q")
        tensor_types[name] = TENSOR_TYPES.get(kind, f"type {kind}")
    align = metadata.get("general.alignment", 32)
    data_start = -(-r.pos // align) * align
    return GGUFHeader(version, metadata, tensor_types, tensor_shapes, tensor_offsets, data_start)
