"""The eviction policies: the contract every one follows (``policy``), the allocations that
share a scorer's rows out (``allocation``) and one policy a module.

Importing a policy's module registers its name for ``parse_policy``; this package imports
them all.
"""

from .adakv import AdaKV
from .adakvzip import AdaKVzip
from .allocation import AcrossHeads, AcrossLayers, Allocation, Pyramid
from .chunkkv import ChunkKV
from .duo import Duo, HeadPattern
from .expected import ExpectedAttention
from .kvzip import KVzip, reconstruction_scores, reconstruction_steps, repeat_prompt
from .policy import POLICIES, BasePolicy, Plan, Policy, parse_policy, register_policy
from .pyramidkv import PyramidKV
from .random import RandomRows
from .snapkv import SnapKV, snapkv_keep_indices
from .streaming import StreamingLLM
