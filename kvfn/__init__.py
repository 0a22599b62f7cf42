"""kvfn: functional, opt-in KV-cache eviction for MLX and mlx-lm models.

import kvfn
fm = kvfn.FunctionalModel(model)                     # any supported mlx-lm model
states, result = kvfn.compact(fm, prompt_ids, kvfn.SnapKV(budget=512))
logits, states = fm.decode(mx.array([[prompt_ids[-1]]]), states)
"""

from .blas import use_openblas

use_openblas()  # before mlx.core is imported anywhere below

from . import distributed  # noqa: E402
from .compaction import compact, compact_prompt_cache, compact_states, compact_steps  # noqa: E402
from .decoding import bounded_decode  # noqa: E402
from .eviction import (  # noqa: E402
    EvictionResult,
    HeadPartitionedEvictionResult,
    evict_prompt_cache,
    evict_prompt_cache_by_head,
)
from .passes import prefill, scored_prefill  # noqa: E402
from .policies import (  # noqa: E402
    AdaKV,
    AdaKVzip,
    ChunkKV,
    Duo,
    ExpectedAttention,
    HeadPattern,
    KVzip,
    Policy,
    PyramidKV,
    RandomRows,
    SnapKV,
    StreamingLLM,
    parse_policy,
    reconstruction_scores,
    reconstruction_steps,
    register_policy,
    repeat_prompt,
    snapkv_keep_indices,
)
from .scores import query_statistics, window_attention_scores  # noqa: E402
from .serving.interop import (  # noqa: E402
    CompactedKVCache,
    QuantizedCompactedKVCache,
    from_mlx_cache,
    load_prompt_cache,
    to_mlx_cache,
)
from .states import cache, partitioned, ragged, ring, slots, tree  # noqa: E402
from .states.cache import (  # noqa: E402
    EMPTY,
    PositionPreservingKVCache,
    evict,
    from_full,
    init,
    mask,
    prefix_trim,
    reserve,
    restrict,
    stack,
    trim,
    update,
)
from .states.partitioned import HeadPartitionedKVCache  # noqa: E402
from .states.ragged import RaggedKVCache  # noqa: E402
from .states.ring import StreamingRing  # noqa: E402
from .states.slots import HeadSlotsKVCache  # noqa: E402
from .wrapper import FunctionalModel, QuerySlice  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    # state and its pure functions
    "PositionPreservingKVCache",
    "EMPTY",
    "cache",
    "init",
    "from_full",
    "update",
    "trim",
    "prefix_trim",
    "evict",
    "restrict",
    "mask",
    "reserve",
    "stack",
    # per-head states (DuoAttention)
    "HeadPartitionedKVCache",
    "StreamingRing",
    "HeadSlotsKVCache",
    "RaggedKVCache",
    "partitioned",
    "ragged",
    "ring",
    "slots",
    "tree",
    # policies
    "Policy",
    "SnapKV",
    "StreamingLLM",
    "RandomRows",
    "ChunkKV",
    "PyramidKV",
    "AdaKV",
    "Duo",
    "HeadPattern",
    "KVzip",
    "AdaKVzip",
    "ExpectedAttention",
    "reconstruction_scores",
    "reconstruction_steps",
    "repeat_prompt",
    "parse_policy",
    "register_policy",
    "snapkv_keep_indices",
    # the model wrapper, prefill and compaction
    "FunctionalModel",
    "QuerySlice",
    "prefill",
    "scored_prefill",
    "window_attention_scores",
    "query_statistics",
    "compact",
    "compact_steps",
    "compact_states",
    "bounded_decode",
    "compact_prompt_cache",
    "evict_prompt_cache",
    "EvictionResult",
    "evict_prompt_cache_by_head",
    "HeadPartitionedEvictionResult",
    # mlx-lm interop
    "CompactedKVCache",
    "QuantizedCompactedKVCache",
    "to_mlx_cache",
    "from_mlx_cache",
    "load_prompt_cache",
    "use_openblas",
    # tensor-parallel models under mlx.launch
    "distributed",
]
