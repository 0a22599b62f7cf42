"""Expected Attention (arXiv:2510.00636): keep the rows that future queries are expected to
attend to, estimated from the prompt's own queries, with no question and no extra pass.

The prefill gathers, per layer and query head, the mean and covariance of the prompt's queries
before RoPE (``statistic = "moments"``; the sinks' queries left out). Future queries are taken
as Gaussian with those moments, rotated by the RoPE of the next ``future`` positions, averaged
(the model's own rope, so any scaling or layout). For a Gaussian query q ~ N(mu, S), a key k
gets E[exp(scale q.k)] = exp(scale mu.k + scale^2 k'Sk / 2): softmax over the prompt's rows
(sinks excluded), times the row's value norm, averaged over the query heads of a KV head.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx

from ..scores import query_statistics
from .policy import Policy, register_policy

MAX_FUTURE = 65536  # positions whose rotations a score averages: a request may set it


def average_rotation(rope, start: int, n: int, dim: int, chunk: int = 1024) -> mx.array:
    """The mean over positions ``start`` .. ``start + n - 1`` of ``rope``'s rotation, as a
    (dim, dim) float32 matrix R with R @ q = mean_t rope(q at t) (rope is linear in q); summed
    ``chunk`` positions at a time, so memory does not grow with ``n``."""
    eye = mx.eye(dim, dtype=mx.float32)
    total = mx.zeros((dim, dim), mx.float32)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        rotated = rope(mx.broadcast_to(eye[None, :, None, :], (1, dim, m, dim)), offset=start + s)
        total = total + mx.sum(rotated[0].astype(mx.float32), axis=1)
    return (total / n).T  # column i: mean_t R(t) e_i


def expected_attention(keys: mx.array, mean: mx.array, cov: Optional[mx.array], scale: float,
                       sinks: int = 0) -> mx.array:  # fmt: skip
    """Softmax over rows of the expected logits of Gaussian queries (after RoPE) on ``keys``
    (B, n_kv, P, D): ``mean`` (B, n_heads, D), ``cov`` (B, n_heads, D, D) or None (the mean
    alone); the first ``sinks`` rows get none. (B, n_heads, P) float32."""
    B, n_kv, P, D = keys.shape
    rep = mean.shape[1] // n_kv
    k = keys.astype(mx.float32)[:, :, None]  # (B, n_kv, 1, P, D)
    mu = mean.reshape(B, n_kv, rep, D, 1)
    logits = scale * (k @ mu)[..., 0]  # (B, n_kv, rep, P)
    if cov is not None:
        spread = k @ cov.reshape(B, n_kv, rep, D, D)  # (B, n_kv, rep, P, D)
        logits = logits + 0.5 * scale**2 * mx.sum(spread * k, axis=-1)
    logits = mx.where(mx.arange(P) < sinks, -mx.inf, logits)
    return mx.softmax(logits, axis=-1, precise=True).reshape(B, n_kv * rep, P)


@register_policy
@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Expected Attention's selection: a KV head keeps the rows with the most attention that
    queries of the next ``future`` positions are expected to pay them (``covariance``: the
    queries' spread counts, ``expected-mean`` drops it), times their value norm
    (``value_norm``; ``-nov`` drops it), averaged over its query heads (``per_head``;
    ``expected-layer``: one row set per layer). Needs no question: a compacted context serves
    new ones; costs nothing beyond the prefill's query moments."""

    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    per_head: bool = True

    name: ClassVar[str] = "expected"
    same_in_every_layer: ClassVar[bool] = True
    needs_scores: ClassVar[bool] = True
    statistic: ClassVar[str] = "moments"
    cannot_recompact: ClassVar[str] = (
        "its expected attention takes the prompt held whole, row i at position i"
    )
    words: ClassVar[dict] = {
        "mean": {"covariance": False},
        "nov": {"value_norm": False},
        "layer": {"per_head": False},
    }
    numbers: ClassVar[dict] = {"f": "future"}

    @property
    def head_local(self) -> bool:
        return self.per_head

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.future <= MAX_FUTURE:
            raise ValueError(
                f"expected future must be 1 to {MAX_FUTURE} positions, got {self.future}"
            )
        for name in ("covariance", "value_norm", "per_head"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"expected {name} must be a bool, got {getattr(self, name)!r}")

    def observation_window(self, prompt_length: int) -> int:
        """Every query after the sinks (their moments, not their attention)."""
        if self.keeps_whole(prompt_length):
            return 0
        return prompt_length - self.sink_tokens

    def scoring(self) -> tuple:
        return (ExpectedAttention.score_prompt, self.future, self.covariance, self.value_norm,
                self.sink_tokens)  # fmt: skip

    def score_prompt(self, fmodel, tokens, states, gathered=None) -> Optional[tuple]:
        P = tokens.shape[1]
        if self.keeps_whole(P):
            return None
        if gathered is None or len(gathered) != len(states):
            raise ValueError("expected attention needs the prefill's query moments "
                             "(scored_prefill with statistic='moments'; kvfn.compact runs it)")  # fmt: skip
        out = []
        for i, (state, moments) in enumerate(zip(states, gathered)):
            B, n_heads = moments.shape[:2]
            if state.sliding_window is not None:  # never evicted
                out.append(mx.zeros((B, n_heads, P), mx.float32))
                continue
            mean, cov = query_statistics(moments)
            rot = average_rotation(fmodel.rope(i), P, self.future, mean.shape[-1])
            mean = mean @ rot.T
            cov = rot @ cov @ rot.T if self.covariance else None
            s = expected_attention(state.keys[:, :, :P], mean, cov, fmodel.scales[i],
                                   self.sink_tokens)  # fmt: skip
            if self.value_norm:
                norms = mx.linalg.norm(state.values[:, :, :P].astype(mx.float32), axis=-1)
                rep = n_heads // norms.shape[1]
                s = s * mx.repeat(norms, rep, axis=1)
            mx.eval(s)  # one layer's (heads x rows x head_dim) terms at a time
            out.append(s)
        return tuple(out)

    def keep_indices(self, scores, *, prompt_length, **kwargs) -> mx.array:
        if scores is not None and scores.ndim == 4:
            raise ValueError("expected attention takes score_prompt's scores, not query moments")
        return super().keep_indices(scores, prompt_length=prompt_length, **kwargs)

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        B, n_heads, P = scores.shape
        s = mx.mean(scores.reshape(B, n_kv_heads, n_heads // n_kv_heads, P), axis=2)
        return s if self.per_head else mx.mean(s, axis=1, keepdims=True)
