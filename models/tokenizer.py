"""Build an mlx-lm TokenizerWrapper from the tokenizer stored in GGUF metadata."""

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .gguf import GGUFError, GGUFHeader

CONTROL = 3  # GGUF token type of special tokens (<|im_start|>, ...)
# llama.cpp pre-tokenizer names whose regex splits digits one by one before GPT-2's regex.
DIGIT_SPLITTING = {"smollm", "qwen2", "deepseek-llm", "starcoder"}


def _bpe(meta: dict) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in DIGIT_SPLITTING:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    special = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def tokenizer_from_gguf(header: GGUFHeader) -> TokenizerWrapper:
    """The GGUF's byte-level BPE tokenizer, chat template and EOS as an mlx-lm TokenizerWrapper."""
    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"tokenizer.ggml.model={kind!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[i]

    hf = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(meta),
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    hf.add_bos_token = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    eos = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    return TokenizerWrapper(hf, eos_token_ids=eos)
