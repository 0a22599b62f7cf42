"""Build an mlx-lm TokenizerWrapper from the tokenizer stored in GGUF metadata."""

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from .gguf import GGUFError, GGUFHeader

CONTROL = 3  # GGUF token type of special tokens (<|im_start|>, ...)
# llama.cpp pre-tokenizer names whose regex splits digits one by one before GPT-2's regex.
DIGIT_SPLITTING = {"smollm", "deepseek-llm", "starcoder"}
# Pre-tokenizers whose split regex is known exactly (from the models' tokenizer.json).
SPLIT_REGEX = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
# Tokens that end a chat turn: an EOS id wherever the chat template uses them.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def _bpe(meta: dict) -> Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = meta.get("tokenizer.ggml.pre")
    if pre in SPLIT_REGEX:
        split = pre_tokenizers.Split(Regex(SPLIT_REGEX[pre]), behavior="isolated")
        bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, bytes_only])
    elif pre in DIGIT_SPLITTING:
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
    return TokenizerWrapper(hf, eos_token_ids=_eos_ids(meta))


def _eos_ids(meta: dict) -> list[int]:
    """EOS and EOT ids, and the ids of end-of-turn tokens that the chat template emits."""
    ids = [
        meta[f"tokenizer.ggml.{k}_token_id"]
        for k in ("eos", "eot")
        if f"tokenizer.ggml.{k}_token_id" in meta
    ]
    template, tokens = meta.get("tokenizer.chat_template") or "", meta["tokenizer.ggml.tokens"]
    ids += [tokens.index(t) for t in END_OF_TURN if t in template and t in tokens]
    return sorted(set(ids))
