"""Tiny random-weight mlx-lm models of several families (no download, a few ms a step)."""

import importlib

import mlx.core as mx

COMMON = dict(hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5, vocab_size=97)

FAMILIES = {
    "llama": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10000.0, rope_traditional=True),
    "qwen2": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rope_theta=10000.0, tie_word_embeddings=False),  # layers is a pipeline slice
    "qwen3": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0),
    "gemma2": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                   rope_theta=10000.0, query_pre_attn_scalar=16.0),
    "gemma3_text": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=16.0),
    "smollm3": dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    rope_theta=10000.0, no_rope_layer_interval=2),  # every 2nd layer without RoPE
}  # fmt: skip


def tiny_model(family: str, seed: int = 0):
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict(dict(model_type=family, **COMMON, **FAMILIES[family]))
    mx.random.seed(seed)
    model = module.Model(args)
    # spread the random weights so attention is far from uniform
    model.update({"model": {"embed_tokens": {"weight": mx.random.normal((97, 64)) * 2.0}}})
    mx.eval(model.parameters())
    return model


def stacked_gap(fm, stacked: list, alone: list, tail: list, steps: int) -> float:
    """Max |logit gap| between a batch and each of its sequences alone: ``tail`` then ``steps``
    greedy tokens (the batch's own) decoded over the ``stacked`` states and over each sequence's
    states in ``alone``."""
    logits, after = fm.forward(mx.array([tail] * len(alone)), stacked)
    for _ in range(steps):  # decode steps write past each sequence's own rows
        token = mx.argmax(logits[:, -1:], axis=-1)
        step, after = fm.forward(token, after)
        logits = mx.concatenate([logits, step], axis=1)
    gap = 0.0
    for b, one in enumerate(alone):
        want, one = fm.forward(mx.array([tail]), one)
        for t in range(steps):
            token = mx.argmax(logits[b : b + 1, len(tail) - 1 + t :][:, :1], axis=-1)
            step, one = fm.forward(token, one)
            want = mx.concatenate([want, step], axis=1)
        gap = max(gap, mx.abs(logits[b] - want[0]).max().item())
    return gap
