"""kvfn: functional, opt-in KV-cache eviction for MLX and mlx-lm models.

import kvfn
fm = kvfn.FunctionalModel(model)                     # any supported mlx-lm model
states, result = kvfn.compact(fm, prompt_ids, kvfn.SnapKV(budget=512))
logits, states = fm.decode(mx.array([[prompt_ids[-1]]]), states)
"""

from .blas import use_openblas

use_openblas()  # before mlx.core is imported anywhere below

from . import cache, distributed, partitioned, ragged, ring, slots, tree  # noqa: E402
from .adakv import AdaKV  # noqa: E402
from .baselines import ChunkKV, RandomRows, StreamingLLM  # noqa: E402
from .cache import (  # noqa: E402
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
from .compact import (  # noqa: E402
    compact,
    compact_prompt_cache,
    compact_states,
    compact_steps,
    prefill,
    scored_prefill,
)
from .duo import Duo, HeadPattern  # noqa: E402
from .eviction import (  # noqa: E402
    EvictionResult,
    HeadPartitionedEvictionResult,
    evict_prompt_cache,
    evict_prompt_cache_by_head,
)
from .expected import ExpectedAttention  # noqa: E402
from .interop import (  # noqa: E402
    CompactedKVCache,
    QuantizedCompactedKVCache,
    from_mlx_cache,
    load_prompt_cache,
    to_mlx_cache,
)
from .kvzip import (  # noqa: E402
    AdaKVzip,
    KVzip,
    reconstruction_scores,
    reconstruction_steps,
    repeat_prompt,
)
from .partitioned import HeadPartitionedKVCache  # noqa: E402
from .policy import Policy, parse_policy, register_policy  # noqa: E402
from .ragged import RaggedKVCache  # noqa: E402
from .ring import StreamingRing  # noqa: E402
from .scores import query_statistics, window_attention_scores  # noqa: E402
from .slots import HeadSlotsKVCache  # noqa: E402
from .snapkv import PyramidKV, SnapKV, snapkv_keep_indices  # noqa: E402
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
