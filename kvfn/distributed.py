"""Eviction on tensor-parallel models: mlx-lm's ``Model.shard(group)`` under ``mlx.launch``.

A sharded model's rank r holds the r-th of ``group.size()`` equal, contiguous slices of every
layer's query and KV heads (``shard_linear`` splits q/k/v_proj's output rows that way), so its
kvfn states hold those KV heads and its scored prefill scores those query heads. Selection:

- a policy whose KV heads choose from their own query heads' scores (``Policy.head_local``,
  e.g. per-head SnapKV) selects on each rank alone, with no communication;
- a score-free policy selects for every head of the layer and keeps this rank's slice;
- any other policy (rows shared by a layer's heads, layer-wide budgets) sees every head's
  scores: they are all-gathered over the group inside the traced eviction, and the policy
  selects for every head as in one process, then each rank keeps its slice.

So every policy keeps, on every rank, exactly the rows it keeps in one process, under the
unchanged policy contract.

    group = mx.distributed.init()
    kvfn.distributed.shard(model, group)     # or model.shard(group)
    fm = kvfn.FunctionalModel(model)         # fm.group is the model's group
    states, result = kvfn.compact(fm, prompt, kvfn.SnapKV(budget=512, per_head=False))
"""

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    shard_linear,
)

SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
MLP_IN = ("gate_proj", "up_proj")
MLP_OUT = "down_proj"


def _out_features(linear: nn.Module) -> int:
    return linear.weight.shape[0]


def _layer_group(i: int, attn: nn.Module, n_heads: int, n_kv_heads: int, head_dim: int):
    """The group layer ``i``'s heads are sharded over (None: not sharded); a ValueError if a
    rank does not hold whole heads."""
    k_proj, q_proj = getattr(attn, "k_proj", None), getattr(attn, "q_proj", None)
    if not isinstance(k_proj, SHARDED):
        return None
    N = k_proj.group.size()
    for name, proj, heads in (("KV", k_proj, n_kv_heads), ("query", q_proj, n_heads)):
        rows = _out_features(proj) if proj is not None else heads * head_dim
        if rows != heads * head_dim:
            raise ValueError(
                f"layer {i} is sharded over {N} ranks but a rank's {name} projection gives "
                f"{rows} features, not {heads} heads x head_dim {head_dim}: the model's "
                f"{rows * N / head_dim:g} {name} heads do not split evenly over {N} ranks "
                "(kvfn.distributed.shard leaves such attention whole)"
            )
    return k_proj.group


def head_group(
    attention: Sequence[nn.Module],
    n_heads: Sequence[int],
    n_kv_heads: Sequence[int],
    head_dims: Sequence[int],
) -> Optional[mx.distributed.Group]:
    """The group a model's attention heads are sharded over (mlx-lm's ``Model.shard``), read
    from its attention modules, or None when every rank holds every head."""
    groups = [
        _layer_group(i, *layer)
        for i, layer in enumerate(zip(attention, n_heads, n_kv_heads, head_dims))
    ]
    found = {id(g): g for g in groups if g is not None}
    if not found:
        return None
    if None in groups or len(found) > 1:
        whole = [i for i, g in enumerate(groups) if g is None]
        raise ValueError(
            f"kvfn needs every layer's heads sharded over one group; layers {whole} are whole "
            f"and {len(found)} groups are used"
        )
    return next(iter(found.values()))


def gather_heads(scores: mx.array, group: mx.distributed.Group) -> mx.array:
    """(B, h, P) scores of this rank's heads -> (B, h * size, P) of every rank's, in rank
    order. ``all_gather`` concatenates along axis 0, so heads go there and back."""
    return mx.distributed.all_gather(scores.swapaxes(0, 1), group=group).swapaxes(0, 1)


def keep_indices(
    policy,
    scores: Optional[mx.array],
    *,
    prompt_length: int,
    n_kv_heads: int,
    batch: int,
    layer: int,
    group: Optional[mx.distributed.Group] = None,
) -> mx.array:
    """``policy.keep_indices`` for the ``n_kv_heads`` heads this rank of ``group`` holds of a
    layer (``scores``: this rank's query heads); equal to the single-process selection's
    slice of those heads. Traceable."""
    local = dict(prompt_length=prompt_length, batch=batch, layer=layer)
    if group is None or group.size() == 1 or (scores is not None and policy.head_local):
        return policy.keep_indices(scores, n_kv_heads=n_kv_heads, **local)
    if scores is not None:
        scores = gather_heads(scores, group)
    idx = policy.keep_indices(scores, n_kv_heads=n_kv_heads * group.size(), **local)
    start = group.rank() * n_kv_heads
    return idx[:, start : start + n_kv_heads]


def _divides(n: Optional[int], size: int) -> bool:
    return isinstance(n, int) and n > 0 and n % size == 0


def heads_divide(model: nn.Module, size: int) -> bool:
    """Whether every layer's query and KV heads split evenly over ``size`` ranks."""
    for layer in model.layers:
        attn = layer.self_attn
        if not (_divides(attn.n_heads, size) and _divides(attn.n_kv_heads, size)):
            return False
    return True


def _shard_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    for name in MLP_IN:
        mlp[name] = shard_linear(mlp[name], "all-to-sharded", group=group)
    mlp[MLP_OUT] = shard_linear(mlp[MLP_OUT], "sharded-to-all", group=group)


def shard(model: nn.Module, group: Optional[mx.distributed.Group] = None) -> bool:
    """Tensor-parallel ``model`` over ``group`` in place: mlx-lm's own ``model.shard(group)``
    when every layer's heads split evenly, else only the MLPs (attention stays whole on every
    rank; mlx-lm's shard would cut heads apart). True when the heads were sharded. The
    sharded weights are evaluated: the full ones are freed, and no lazy slice is left for
    another thread (mlx-lm's server generates on its own) to evaluate without this stream."""
    group = group or mx.distributed.init()
    if group.size() == 1:
        return False
    if not hasattr(model, "shard"):
        raise TypeError(f"{type(model).__module__} has no shard(group) (llama, qwen2, qwen3 do)")
    heads = heads_divide(model, group.size())
    if heads:
        model.shard(group)
    else:
        _shard_mlps(model, group)
    mx.eval(model.parameters())
    return heads


def _shard_mlps(model: nn.Module, group: mx.distributed.Group) -> None:
    """Every layer's MLP, after checking that all of them split (nothing is changed if not)."""
    mlps = [getattr(layer, "mlp", None) for layer in model.layers]
    for i, mlp in enumerate(mlps):
        widths = [_out_features(mlp[n]) for n in MLP_IN] if mlp is not None else []
        if not widths or not all(_divides(w, group.size()) for w in widths):
            raise ValueError(
                f"layer {i}: neither its heads nor its MLP width {widths} split over "
                f"{group.size()} ranks"
            )
    for mlp in mlps:
        _shard_mlp(mlp, group)
