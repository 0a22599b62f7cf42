"""kvfn-server: mlx-lm's OpenAI-compatible server (mlx-lm 0.32) with opt-in KV-cache eviction.

    kvfn-server                                   # embedded SmolLM2, no eviction: mlx_lm.server
    kvfn-server --kv-eviction snapkv --kv-budget 256 --port 0
    python -m kvfn.serving.server --model path/to/model.gguf --kv-eviction streaming
    .venv/bin/mlx.launch --backend ring -n 2 .venv/bin/python -m kvfn.serving.server --kv-eviction snapkv
        # tensor parallel (kvfn.distributed.shard): rank 0 serves HTTP, KV bytes are per rank

Endpoints, flags, sampling, chat templates, continuous batching and the prompt cache are
mlx-lm's own (``mlx_lm.server``): this module subclasses its ``ModelProvider``,
``LRUPromptCache``, ``ResponseGenerator``, ``BatchGenerator`` and ``APIHandler``. With
``--kv-eviction none`` (the default) requests take mlx-lm's path unchanged.

With a policy, a prompt longer than the floor (``--kv-min-tokens`` and ``--kv-budget``) gets a
fresh, scored prefill of all but its last token and its compaction
(``kvfn.compaction.compact_steps``), run as a job that the batch generator advances one step (a
prefill chunk or a scoring chunk) per decode step of the other sequences, as mlx-lm interleaves
its own prompt processing; its caches (``kvfn.to_mlx_cache``) then go to mlx-lm's batch, which
decodes from the last prompt token. Shorter prompts are prefilled by mlx-lm as usual, into kvfn
caches (lossless, rows equal to positions) so that every sequence in a batch has the same batch
cache class (``kvfn.serving.interop.BatchCompactedKVCache``). Each response's ``usage.kv_eviction`` gives
the rows and bytes kept; ``/health`` and ``/metrics`` give the KV bytes held (a pending
compaction counts the bytes of its prefill's states) and ``compacting_sequences``.

Prompt-cache reuse rule (eviction on):
  1. A cache from which eviction removed any row (stored rows < true offset in some layer) is
     never inserted into the prompt cache, neither at the end of a generation nor as a segment,
     so no later request can start from it as if it held the whole prefix.
  2. A prompt longer than the floor is always prefilled fresh and compacted: it ignores any
     cached prefix, so which rows are kept depends only on the prompt and the policy.
  3. Shorter prompts use the prompt cache as mlx-lm does; every entry they find is lossless.
  4. With a per-head policy (``--kv-eviction duo --kv-head-pattern DIR``, or ``adakv``) every
     prompt is prefilled by kvfn and decoded from per-head caches
     (``kvfn.serving.batch.HeadPartsKVCache``: each layer's head parts apart, batched by
     ``BatchHeadPartsKVCache``, attention per part through ``kvfn.wrapper.attending_copy``);
     none of them enters the prompt cache. A request may then name the server's policy or a
     plain one, not a per-head policy of other head parts.
  5. With a query-agnostic policy (``Policy.query_agnostic``: its rows do not depend on the
     question) a request's shared context (a chat's messages before its last user message, or
     the body's ``kv_context_tokens`` first tokens) is compacted once and kept, keyed by those
     tokens, the policy's full settings and ``kv_max_rows``; a later request starting with the
     same tokens prefills only its rest over it (``usage.prompt_tokens_details.cached_tokens``:
     the context's rows; ``usage.kv_eviction.reused``). The rest is held whole, so only a rest
     within the budget (and the cap) takes this rule; a longer one is compacted with its
     context as rule 2 says. Only exact keys match: a kept context is never trimmed or extended
     into another one. Requests on one context while it is being compacted wait for that
     compaction; one whose client leaves stores nothing. At most ``--prompt-cache-size``
     contexts are kept besides mlx-lm's entries, their compacted bytes count against
     ``--prompt-cache-bytes``, and they are dropped before mlx-lm's entries. Query-aware
     compactions are never kept.
"""

import argparse
import gc
import json
import logging
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from http.server import ThreadingHTTPServer
from pathlib import Path
from queue import Empty as QueueEmpty
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
from mlx_lm import server as mlx_server
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
)
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.server import (
    APIHandler,
    GenerationContext,
    ModelProvider,
    ResponseGenerator,
    TimeBudget,
)

from .. import distributed
from ..compaction import check_bounded, check_probe, compact_steps
from ..decoding import check_generating
from ..eviction import kept
from ..passes import _prefill_steps, prefill
from ..states import tree
from ..states.ragged import as_ragged
from ..wrapper import FunctionalModel, attending_copy, bucket
from . import flags
from .batch import HeadPartsKVCache
from .flags import (
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from .interop import CompactedKVCache, QuantizedCompactedKVCache, evicting, to_mlx_cache
from .shell import StateCache

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


# -- flags ---------------------------------------------------------------------------------------
KV_BITS = (1, 2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def byte_size(text: str) -> int:
    try:
        return mlx_server._parse_size(text)
    except (ArithmeticError, KeyError, ValueError):  # decimal.InvalidOperation, unknown unit
        raise argparse.ArgumentTypeError(f"must be a size such as 500M or 2GB, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's flags (its ``main`` builds and parses them inline, so they cannot be
    imported), then kvfn's."""
    p = argparse.ArgumentParser(description="kvfn-server: mlx_lm.server with KV-cache eviction")
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--adapter-path", help="not supported (kept for mlx_lm.server's flag set)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8080, help="0 picks a free port")
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*")
    p.add_argument("--draft-model", help="not supported (kept for mlx_lm.server's flag set)")
    p.add_argument("--num-draft-tokens", type=non_negative_int, default=3)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    p.add_argument("--chat-template", default="")
    p.add_argument("--use-default-chat-template", action="store_true")
    p.add_argument("--temp", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--min-p", type=probability, default=0.0)
    p.add_argument("--max-tokens", type=positive_int, default=512)
    p.add_argument("--chat-template-args", type=json_object, default="{}")
    p.add_argument("--decode-concurrency", type=positive_int, default=32)
    p.add_argument("--prompt-concurrency", type=positive_int, default=8)
    p.add_argument("--prefill-step-size", type=positive_int, default=2048)
    p.add_argument("--prompt-cache-size", type=non_negative_int, default=10)
    p.add_argument("--prompt-cache-bytes", type=byte_size)
    p.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None)
    p.add_argument("--kv-group-size", type=int, choices=KV_GROUP_SIZES, default=64)
    p.add_argument(
        "--quantized-kv-start",
        type=non_negative_int,
        default=mlx_server.DEFAULT_QUANTIZED_KV_START,
    )
    p.add_argument("--pipeline", action="store_true")
    p.add_argument("--kv-warmup", action=argparse.BooleanOptionalAction,
                   help="run one request of the policy at start (a synthetic prompt through "
                   "the compaction and the batch decode), so the CUDA kernels and compiled "
                   "functions a first request builds are built before the port serves "
                   "(default: on where MLX's default device is the GPU)")  # fmt: skip
    p.add_argument("--kv-step-layers", type=positive_int, metavar="N",
                   help="a compaction step evaluates at most N layers of its forward, so the "
                   "other streams wait about N/layers of a prefill chunk a step (default: the "
                   "whole forward; kvfn.compact_steps' layers_per_step)")  # fmt: skip
    flags.add_arguments(p, "none, or a policy: chunkkv (recommended: a request's prompt ends "
                        "with its question, and chunkkv kept the full cache's answers at 12.5%% "
                        "of the rows there: Qwen2.5-Coder-0.5B 87-88 of 89-90 at 4K-16K tokens, "
                        "78 [74, 82] of 81 at 32K; the 1.5B 81-87 of 85-90; "
                        "docs/evaluation.md), snapkv, adakvzip-global (for prompts cached "
                        "before their questions), streaming, ...")  # fmt: skip
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("adapter_path", "draft_model"):
        if getattr(args, flag):
            parser.error(f"argument --{flag.replace('_', '-')}: not supported by kvfn-server")
    flags.read(args, parser)
    return args


# -- model loading ------------------------------------------------------------------------------
class KVModelProvider(ModelProvider):
    """mlx-lm's provider, loading through ``kvfn_models`` (GGUF files, the embedded SmolLM2),
    serving the one model named at startup."""

    def __init__(self, cli_args):
        super().__init__(cli_args)
        self.model_id = str(Path(cli_args.model).resolve()) if cli_args.model else EMBEDDED_NAME
        self.names = {"default_model", self.model_id} | ({cli_args.model} - {None})
        self._functional = None
        self.head_parts = None  # per layer, with a per-head policy (see head_parts_of)
        self.ragged = False  # a policy that stores its layers ragged (Policy.ragged)

    def check_model(self, name) -> None:
        if name not in self.names:
            raise ValueError(f"unknown model {name!r}: this server serves {self.model_id!r}")

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        self.check_model(model_path)
        if adapter_path is not None or draft_model_path not in (None, "default_model"):
            raise ValueError("kvfn-server serves no adapters or draft models")
        return super().load("default_model", None, "default_model")

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        # mlx-lm's _load calls mlx_lm.utils.load, which cannot read GGUF files.
        import kvfn_models

        self.reset()
        self._functional = None
        gc.collect()
        mx.clear_cache()
        model, tokenizer = kvfn_models.load(model_path)
        if self.pipeline_group is not None:
            raise ValueError("kvfn-server runs tensor parallel under mlx.launch, not --pipeline")
        if self.tensor_group is not None:
            distributed.shard(model, self.tensor_group)
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        if self.cli_args.chat_template:
            hf.chat_template = self.cli_args.chat_template
        elif self.cli_args.use_default_chat_template and hf.chat_template is None:
            hf.chat_template = hf.default_chat_template
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.processor, self.draft_model = model, tokenizer, None, None
        self.base_model = model
        caches = make_prompt_cache(model)
        if self.cli_args.policy is None:
            self.is_batchable = all(hasattr(c, "merge") for c in caches)
        else:  # kvfn's batch cache covers plain full-attention layers only
            self.is_batchable = all(type(c) is KVCache for c in caches)
        self.head_parts = head_parts_of(self.cli_args.policy, self.functional_model())
        self.ragged = self.cli_args.policy is not None and self.cli_args.policy.ragged
        if self.per_head and (not self.is_batchable or self.tensor_group is not None):
            raise ValueError(
                f"{self.cli_args.policy.name} keeps per-head rows, served only for a "
                "single-process model whose layers all use full attention"
            )
        if self.cli_args.kv_max_rows is not None:
            fm = self.functional_model()
            check_bounded(fm.sliding_windows, self.cli_args.policy, self.cli_args.kv_max_rows, 1)
        if self.cli_args.kv_decode_interval is not None:
            check_generating(self.cli_args.policy, self.cli_args.kv_decode_interval,
                             self.functional_model().sliding_windows)  # fmt: skip
        if self.cli_args.policy is not None and self.is_batchable:
            # each layer's batch cache attends with its own mask (per-layer row counts, heads)
            self.model = attending_copy(model)

    @property
    def per_head(self) -> bool:
        """Whether the server's policy keeps per-head rows: its layers stored ragged or in head
        parts (rule 4)."""
        return self.ragged or self.head_parts is not None

    def functional_model(self):
        if self._functional is None:
            self._functional = FunctionalModel(self.base_model)
        return self._functional

    @property
    def context_length(self):
        args = getattr(self.model, "args", None)
        return getattr(args, "max_position_embeddings", None) or getattr(
            args, "context_length", None
        )


def head_parts_of(policy, fm) -> Optional[list]:
    """Per layer, the KV-head parts a per-head policy stores apart (``Policy.head_parts``);
    None for a policy whose layers are plain states."""
    if policy is None:
        return None
    parts = [policy.head_parts(i, h) for i, h in enumerate(fm.n_kv_heads)]
    if all(g is None for g in parts):
        return None
    return [g or (tuple(range(h)),) for g, h in zip(parts, fm.n_kv_heads)]


# -- one request's failure ----------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection: its request's work stops at the next step."""


class RequestFailed(Exception):
    """One request failed in the generation loop; ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def request_failure(error: Exception) -> Exception:
    """What a request is answered when ``error`` ends its work: a ``ValueError`` of kvfn's own
    checks (the input is at fault) is a 400; anything else, MLX's own errors included (their
    messages start with "[op]"), a 500 that names it. A client that left stays ``ClientGone``."""
    if isinstance(error, (RequestFailed, ClientGone)):
        return error
    if isinstance(error, ValueError) and not str(error).startswith("["):
        return RequestFailed(400, str(error))
    return RequestFailed(500, f"kvfn-server failed on this request: {type(error).__name__}: "
                              f"{error}")  # fmt: skip


def _raising(error: Exception):
    """A job whose first step raises ``error``."""
    raise error
    yield  # noqa: unreachable: makes this a generator


# -- the prompt cache: compaction and the reuse rule -------------------------------------------
def is_lossy(cache) -> bool:
    """True when eviction removed rows from this layer (stored rows below its true offset)."""
    lossy = isinstance(cache, (CompactedKVCache, QuantizedCompactedKVCache))
    return lossy and cache.sliding_window is None and cache.rows < cache.offset


def as_kvfn_cache(cache):
    """A plain ``KVCache`` as a lossless ``CompactedKVCache`` (rows at positions 0..n-1)."""
    if isinstance(cache, CompactedKVCache):
        return cache
    n = cache.offset
    keys, values = cache.keys[:, :, :n], cache.values[:, :, :n]
    positions = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (1, keys.shape[1], n))
    return CompactedKVCache(keys, values, mx.array(positions), n)


class PendingCompaction:
    """What ``fetch_nearest_cache`` gives mlx-lm in place of a prompt's caches when it compacts
    the prompt: the compaction's steps, not yet run. ``TrackedBatchGenerator`` keeps the
    sequence aside and advances its job one step per batch step; the caches it returns are the
    sequence's. ``nbytes``: what its prefill's states hold."""

    def __init__(self, steps, nbytes: int, gone=None):
        self.steps, self.nbytes = steps, nbytes
        self.gone = gone  # the client's check: True once it has left (ClientGone)
        self.progress = (0, 0)  # (done, total) after the latest step

    def advance(self) -> Optional[list]:
        """Run one step: None, or the sequence's caches once the job has returned them."""
        try:
            self.progress = next(self.steps)
        except StopIteration as end:
            return end.value
        return None

    def finish(self) -> list:
        """Run every step left, now; ``ClientGone`` before a step once the client has left."""
        while True:
            if self.gone is not None and self.gone():
                self.close()
                raise ClientGone()
            caches = self.advance()
            if caches is not None:
                return caches

    def close(self) -> None:
        """Drop the job and the arrays it holds."""
        self.steps.close()


def prefill_bytes(fm, n: int) -> int:
    """Bytes of states of ``n`` rows (made lazily: nothing is allocated); a compaction's
    prefill holds its prompt's ``bucket``."""
    return sum(a.nbytes for a in tree.arrays(fm.init_states(1, n)))


def reuses(policy, tokens: int, n: int, max_rows: Optional[int]) -> bool:
    """Whether a prompt of ``tokens`` tokens takes rule 5: a shared context of its first ``n``
    tokens longer than ``policy`` keeps whole, and a rest short enough that holding it whole
    keeps the policy's bounds (at most its budget, and within ``max_rows``)."""
    rest = tokens - n
    fits = max_rows is None or policy.budget + rest <= max_rows
    return n > 0 and not policy.keeps_whole(n - 1) and rest <= policy.budget and fits


class EvictingPromptCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` holding the reuse rule (module docstring) and the compaction.

    mlx-lm's generation loop asks ``fetch_nearest_cache`` for the caches of every request, right
    after tokenizing it, on the generation thread: for a prompt over the floor this returns a
    ``PendingCompaction`` and the last prompt token as the rest, so that mlx-lm's own batching
    decodes the sequence once the batch generator has run the job. On mlx-lm's one-request path
    (``_serve_single``: ``interleave`` False) the compaction runs whole, there and then.
    """

    def __init__(self, provider: KVModelProvider, max_size: int = 10):
        super().__init__(max_size)
        self.provider = provider
        self.policy = provider.cli_args.policy  # set per request by the response generator
        self.max_rows = provider.cli_args.kv_max_rows  # so is this
        self.probe = provider.cli_args.kv_probe  # and this (not for a shared context's)
        self.decode_interval = provider.cli_args.kv_decode_interval  # and this
        self.step_layers = provider.cli_args.kv_step_layers
        self.context_tokens = 0  # and this: the shared context a query-agnostic policy reuses
        # (policy, max_rows, context tokens) -> (states, result, bytes)
        self.contexts = OrderedDict()
        self.context_bytes = 0  # theirs, kept as they change (the HTTP threads read it)
        self.compacting = set()  # the keys of contexts being compacted now
        self.interleave = True
        self.gone = None  # set per request: its client's check (KVAPIHandler.client_gone)
        self.evictions = OrderedDict()  # (policy, prompt) -> usage fields, the latest 256
        self.compacted_requests = 0
        self.refused_inserts = 0
        self.failed_inserts = 0

    def fetch_nearest_cache(self, model, tokens):
        """The request's caches and the tokens left to process. On the batch path a failure
        is the request's own: a job whose first step raises it, so the batch generator fails
        that sequence alone."""
        try:
            return self._fetch(model, tokens)
        except Exception as e:
            if not self.interleave:
                raise
            return PendingCompaction(_raising(e), 0), tokens[-1:]

    def _fetch(self, model, tokens):
        policy = self.policy
        if policy is not None and policy.keeps_whole(len(tokens) - 1):
            self.note_kept_whole(policy, tokens)
        n = self.context_tokens
        if policy is not None and reuses(policy, len(tokens), n, self.max_rows):
            return self.reuse(tokens, policy, n), tokens[-1:]
        if self.provider.per_head:  # rule 4
            if policy is None or policy.keeps_whole(len(tokens) - 1):
                fm, step = (
                    self.provider.functional_model(),
                    self.provider.cli_args.prefill_step_size,
                )
                if len(tokens) == 1:
                    states = fm.init_states(1, 1)
                else:  # fresh states: prefill reuses their buffers
                    states = prefill(fm, mx.array([tokens[:-1]]), capacity=len(tokens),
                                          prefill_step_size=step)  # fmt: skip
                return self.as_mlx_caches(states, policy), tokens[-1:]
            return self.compaction(tokens, policy), tokens[-1:]
        if policy is not None and not policy.keeps_whole(len(tokens) - 1):
            return self.compaction(tokens, policy), tokens[-1:]
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and not rest and can_trim_prompt_cache(cache):
            # an exact hit leaves mlx-lm's batch path an empty prompt, which kills its
            # generation thread: recompute the last token instead (same state, same output)
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        if self.provider.cli_args.policy is None or not self.provider.is_batchable:
            return cache, rest
        if cache is None:  # mlx-lm batches one cache class: every sequence gets kvfn's
            fm = self.provider.functional_model()
            caches = to_mlx_cache(fm.init_states(1, 0))
        else:
            caches = [as_kvfn_cache(c) for c in cache]
        return evicting(caches, policy, self.decode_interval), rest

    def compaction(self, tokens, policy):
        """The compaction of all but the last of ``tokens``: a ``PendingCompaction``, or its
        caches when it cannot be interleaved."""
        fm = self.provider.functional_model()
        step = self.provider.cli_args.prefill_step_size
        tokenized = policy.for_tokenizer(self.provider.tokenizer)  # KVzip's repeat instruction
        steps = compact_steps(fm, tokens, tokenized, max_new_tokens=1, prefill_step_size=step,
                              max_rows=self.max_rows, probe=self.probe, pass_step_size=step,
                              layers_per_step=self.step_layers)  # fmt: skip
        job = PendingCompaction(self._caches_after(steps, policy, tokens, self.decode_interval,
                                                   self.probe),
                                prefill_bytes(fm, bucket(len(tokens) - 1)), self.gone)  # fmt: skip
        return job if self.interleave else job.finish()

    def reuse(self, tokens, policy, n: int):
        """The caches of a prompt whose first ``n`` tokens are a shared context (rule 5): that
        context compacted once and kept, then the rest prefilled over it; a
        ``PendingCompaction``, or its caches when it cannot be interleaved."""
        fm = self.provider.functional_model()
        tokenized = policy.for_tokenizer(self.provider.tokenizer)
        key = (tokenized, self.max_rows, tuple(tokens[:n]))
        held = len(tokens) - n if key in self.contexts else len(tokens) - 1
        job = PendingCompaction(self._reused(fm, tokens, policy, key, n, self.decode_interval),
                                prefill_bytes(fm, bucket(held)), self.gone)  # fmt: skip
        return job if self.interleave else job.finish()

    def _reused(self, fm, tokens, policy, key, n: int, interval):
        tokenized, max_rows, _ = key
        while key in self.compacting:  # another request compacts this context: its result
            yield 0, 1
        reused = key in self.contexts
        if reused:
            self.contexts.move_to_end(key)
            states, result, _ = self.contexts[key]
        else:
            self.compacting.add(key)
            try:  # a job closed here (its client gone) stores nothing
                step = self.provider.cli_args.prefill_step_size
                states, result = yield from compact_steps(fm, tokens[:n], tokenized,
                                                          max_new_tokens=0, prefill_step_size=step,
                                                          max_rows=max_rows,
                                                          pass_step_size=step,
                                                          layers_per_step=self.step_layers)  # fmt: skip
            finally:
                self.compacting.discard(key)
            self.keep_context(key, states, result)
            self.compacted_requests += 1
        step = self.provider.cli_args.prefill_step_size
        rest, _ = yield from _prefill_steps(fm, mx.array([tokens[n - 1 : -1]]), states=states,
                                            capacity=None, prefill_step_size=step, dtype=None,
                                            compiled=False, settle=True,
                                            layers=self.step_layers)  # fmt: skip
        held = [kept(s) for s in rest]  # the context's kept rows and the rest's, per layer
        whole = (len(tokens) - 1) / max(n - 1, 1)
        self.note(policy, tokens, {
            "kept_whole": False,
            "reused": reused,
            "context_tokens": n,
            "rows_kept": sum(r for r, _ in held),
            "rows_total": result.total_rows_before + (len(tokens) - n) * len(rest),
            "bytes_kept": sum(b for _, b in held),
            "bytes_total": round(result.total_bytes_before * whole),
        })  # fmt: skip
        return self.as_mlx_caches(rest, policy, interval)

    def keep_context(self, key, states, result) -> None:
        """Store a compacted context (at its compacted size), the least recently used ones
        making room: at most ``--prompt-cache-size`` contexts (besides mlx-lm's entries), and
        their bytes and mlx-lm's within ``--prompt-cache-bytes``."""
        nbytes = sum(a.nbytes for a in tree.arrays(states))
        self.contexts[key] = (states, result, nbytes)
        self.context_bytes += nbytes
        limit = self.provider.cli_args.prompt_cache_bytes
        while len(self.contexts) > self.max_size or (
            limit is not None and self.nbytes > limit and self.contexts
        ):
            self.drop_context()

    def drop_context(self) -> None:
        """Drop the least recently used compacted context."""
        self.context_bytes -= self.contexts.popitem(last=False)[1][2]

    @property
    def nbytes(self) -> int:
        """mlx-lm's entries' bytes and the compacted contexts'."""
        return LRUPromptCache.nbytes.fget(self) + self.context_bytes

    def trim_to(self, *, n_sequences=None, n_bytes=None):
        """mlx-lm's trim, the compacted contexts counted in the bytes (and dropped first)."""
        if n_bytes is not None:
            while self.contexts and self.nbytes > n_bytes:
                self.drop_context()
            n_bytes -= self.context_bytes
        super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def note(self, policy, tokens, usage: dict) -> None:
        """Record a request's ``usage.kv_eviction`` (the latest 256 prompts)."""
        self.evictions[(policy, tuple(tokens))] = {"policy": policy.name, **usage}
        while len(self.evictions) > 256:
            self.evictions.popitem(last=False)

    def note_kept_whole(self, policy, tokens) -> None:
        """A prompt within the policy's budget (or ``min_tokens``): every row kept."""
        fm = self.provider.functional_model()
        n = len(tokens) - 1
        rows, nbytes = n * sum(fm.n_kv_heads), prefill_bytes(fm, n)
        self.note(policy, tokens, {"kept_whole": True, "rows_kept": rows, "rows_total": rows,
                                   "bytes_kept": nbytes, "bytes_total": nbytes})  # fmt: skip

    def _caches_after(self, steps, policy, tokens, interval, probe=False):
        """``steps``, then the caches of the states they return (their eviction recorded;
        ``probe``: whether a probed compaction ran, one while prefilling, which leaves the last
        compaction fewer rows than the context's)."""
        states, result = yield from steps
        probed = probe and max(result.rows_before) < len(tokens) - 1
        caches = self.as_mlx_caches(states, policy, interval)
        self.note(policy, tokens, {
            "kept_whole": False,
            "rows_kept": result.total_rows_after,
            "rows_total": result.total_rows_before,
            "bytes_kept": result.total_bytes_after,
            "bytes_total": result.total_bytes_before,
            **({} if result.peak_rows is None else {"peak_rows": result.peak_rows}),
            **({"probe": True} if probed else {}),
        })  # fmt: skip
        self.compacted_requests += 1
        return caches

    def as_mlx_caches(self, states, policy, interval=None) -> list:
        """mlx-lm caches of one sequence's states: with a per-head policy, ragged layers
        (``StateCache``s, a plain state's heads each keeping all its rows) or per-head
        caches in the server's head parts; else ``kvfn.to_mlx_cache``'s, evicting every
        ``interval`` tokens where the request asks (a job passes its request's own, taken when it
        was made: ``self.decode_interval`` is the latest request's by the time the job ends)."""
        if self.provider.ragged:
            return [StateCache(as_ragged(s)) for s in states]
        parts = self.provider.head_parts
        if parts is None:
            return evicting(to_mlx_cache(states), policy, interval)
        return [HeadPartsKVCache.from_state(s, g) for s, g in zip(states, parts)]

    def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
        per_head = lambda c: isinstance(c, HeadPartsKVCache) or type(c) is StateCache  # noqa: E731
        if any(is_lossy(c) or per_head(c) for c in prompt_cache):
            self.refused_inserts += 1
            return
        try:  # a cache that cannot be stored costs a later request its reuse, nothing more
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        except Exception:
            logging.exception("kvfn-server: a prompt cache entry could not be stored")
            self.failed_inserts += 1

    def lossy_entries(self) -> int:
        """Entries that break rule 1 (always 0; the tests read it)."""
        return sum(
            any(is_lossy(c) for c in self._trie.get(model, tokens).prompt_cache)
            for lru in self._lru._lrus.values()
            for model, tokens in lru
        )


# -- generation ---------------------------------------------------------------------------------
_LIVE_BATCHES = weakref.WeakSet()
_handler = threading.local()  # on an HTTP thread: its request's client check
# id(request) -> its client's check (KVAPIHandler.client_gone), while its handler runs; kept
# off the request, which mlx.launch's rank 0 pickles for the other ranks
_CLIENTS = {}
_NOTHING = object()  # what a wait on a request's queue got when it timed out


class TrackedBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator``, running kvfn's compactions between its decode steps, and
    noting after each step the KV bytes and sequences it holds (read by /health from the HTTP
    threads without touching the generation thread's arrays).

    A sequence whose cache is a ``PendingCompaction`` waits in ``_jobs`` (mlx-lm's sequence
    tuples, oldest first). Each ``_next`` runs one step of the oldest job, reported as a
    prompt-processing response (the server sends its progress to the client as mlx-lm's
    keepalive), then mlx-lm's own (a decode step of the generation batch, then at most one
    chunk of prompt processing): the tokens mlx-lm's step makes are handed out without waiting
    for the job's. A finished job's sequence joins mlx-lm's queue with its caches, first in
    line. A pending sequence has no cache to extract; removing it drops its job. While other
    prompts wait to be processed, a job steps only every ``JOB_EVERY``-th loop step: a prompt
    that arrives during a long compaction is not slowed to the compaction's pace, and the job
    still goes on.

    Failures are one request's: a job step that raises (or whose client has left) drops that
    job alone; a step of mlx-lm's own batches that raises (a batched prefill chunk or decode
    step, which no one sequence can be blamed for) drops the sequences of those batches. A
    failed sequence's error (``request_failure``) is reported as its prompt response at every
    step until the server removes it, which frees nothing more: its rows went with the job or
    the batch."""

    JOB_EVERY = 4

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._jobs = deque()
        self._waited = 0  # loop steps the oldest job has waited for other prompts
        self._failed = {}  # uid -> the exception its request is answered with
        self.kv_bytes, self.sequences, self.compacting = 0, 0, 0
        _LIVE_BATCHES.add(self)

    def _note(self):
        self.kv_bytes = self.prompt_cache_nbytes
        self.compacting = len(self._jobs)
        self.sequences = (
            len(self._unprocessed_sequences)
            + len(self._prompt_batch)
            + len(self._generation_batch)
            + len(self._jobs)
        )

    @property
    def prompt_cache_nbytes(self):
        return super().prompt_cache_nbytes + sum(s[3].nbytes for s in self._jobs)

    def next(self):
        out = super().next()
        self._note()
        return out

    def _next(self):
        # the job's step first, so that the tokens mlx-lm's step makes next are handed out as
        # soon as they are made, not after the job's step (a new request's first token)
        self._drop_abandoned_jobs()
        job_responses = []
        if not self._jobs:
            self._waited = 0  # the next job waits from nothing
        elif len(self._generation_batch) < self.completion_batch_size:
            if self._waited + 1 >= self.JOB_EVERY or not self._prompts_waiting():
                self._waited = 0
                job_responses = self._advance_job()
            else:
                self._waited += 1
        queued = {s[0] for s in self._unprocessed_sequences}
        held = {*self._prompt_batch.uids, *self._generation_batch.uids, *queued}
        try:
            prompt_responses, generation_responses = super()._next()
        except Exception as e:
            logging.exception("kvfn-server: a batched step failed; its sequences fail")
            prompt_responses, generation_responses = [], []
            # the step may have moved sequences out of the queue or the batches before it
            # raised (a merge, a split into decoding, a finish): each of them fails too
            still_queued = {s[0] for s in self._unprocessed_sequences}
            self._fail_batches(e, held - still_queued)
        prompt_responses = job_responses + prompt_responses
        for uid, error in self._failed.items():
            prompt_responses.append(PromptProcessingBatch.Response(uid, error, False, False))
        return prompt_responses, generation_responses

    def _prompts_waiting(self) -> bool:
        """Whether mlx-lm has prompts to process (in its prompt batch or queued)."""
        return len(self._prompt_batch) > 0 or len(self._unprocessed_sequences) > 0

    def _advance_job(self) -> list:
        """One step of the oldest job: its progress as a prompt response, or none when it
        failed (``_failed`` reports it)."""
        sequence = self._jobs[0]
        job = sequence[3]
        tic = time.perf_counter()
        try:
            caches = job.advance()
        except Exception as e:
            if not isinstance(e, ClientGone):
                logging.exception("kvfn-server: a compaction step failed; its request fails")
            self._fail_job(sequence, e)
            return []
        finally:
            self._counters.prompt_time += time.perf_counter() - tic
        if caches is not None:
            self._jobs.popleft()
            self._unprocessed_sequences.appendleft((*sequence[:3], caches, *sequence[4:]))
        return [PromptProcessingBatch.Response(sequence[0], job.progress, False, False)]

    def _fail_job(self, sequence, error: Exception) -> None:
        sequence[3].close()
        self._jobs = deque(s for s in self._jobs if s is not sequence)
        self._failed[sequence[0]] = request_failure(error)

    def _drop_abandoned_jobs(self) -> None:
        """Jobs whose clients have left go now, not when their turn comes."""
        for sequence in list(self._jobs):
            gone = sequence[3].gone
            if gone is not None and gone():
                self._fail_job(sequence, ClientGone())

    def _fail_batches(self, error: Exception, uids: set) -> None:
        """mlx-lm's prompt and generation batches failed in one step: ``uids`` and their
        sequences fail with a 500 (no one input is at fault), and the batches start empty (what
        the failed step left in them is not reused)."""
        failure = RequestFailed(500, f"kvfn-server failed on a batched step: "
                                     f"{type(error).__name__}: {error}")  # fmt: skip
        for uid in {*uids, *self._prompt_batch.uids, *self._generation_batch.uids}:
            self._failed[uid] = failure
        self._prompt_batch = PromptProcessingBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )
        self._generation_batch = GenerationBatch.empty(self.model, self.sampler)
        self._currently_processing = []

    def insert_segments(self, *args, **kwargs):
        out = super().insert_segments(*args, **kwargs)
        queue = self._unprocessed_sequences
        if any(isinstance(s[3], PendingCompaction) for s in queue):
            self._jobs.extend(s for s in queue if isinstance(s[3], PendingCompaction))
            self._unprocessed_sequences = deque(
                s for s in queue if not isinstance(s[3], PendingCompaction)
            )
        self._note()
        return out

    def remove(self, uids, return_prompt_caches=False):
        gone = set(uids)
        for sequence in self._jobs:
            if sequence[0] in gone:
                sequence[3].close()
        self._jobs = deque(s for s in self._jobs if s[0] not in gone)
        self._failed = {uid: e for uid, e in self._failed.items() if uid not in gone}
        out = super().remove(uids, return_prompt_caches)
        self._note()
        return out


class KVResponseGenerator(ResponseGenerator):
    """mlx-lm's generation thread; it hands each request's policy and its client's check to
    the prompt cache, and says why it stopped if it ever does (``failure``).

    On the HTTP threads, ``_await_response`` (each item a request's queue gives) raises
    ``ClientGone`` once the request's client has left, having stopped its generation context,
    so that the loop removes the sequence at its next step.

    It takes new requests after every ``REQUEST_POLL_S`` of batch steps, where mlx-lm waits
    0.5 s: a request that arrives while a compaction's steps run joins the loop at once, not up
    to half a second later (on this CPU that wait was most of such a request's first token)."""

    failure = None  # why the generation thread stopped, once it has
    REQUEST_POLL_S = 0.02

    def _run_generate(self):
        self._time_budget = TimeBudget(budget=self.REQUEST_POLL_S)  # the loop's own thread
        try:
            self._generate()
        except Exception as e:  # mlx-lm's own, noting why
            logging.exception(f"kvfn-server generation thread died: {e}")
            self.failure = f"the generation thread stopped: {type(e).__name__}: {e}"
            self._generation_failed = True

    def _tokenize(self, tokenizer, request, args):
        self.prompt_cache.policy = getattr(request, "kv_policy", self.cli_args.policy)
        self.prompt_cache.max_rows = getattr(request, "kv_max_rows", self.cli_args.kv_max_rows)
        self.prompt_cache.probe = getattr(request, "kv_probe", self.cli_args.kv_probe)
        self.prompt_cache.decode_interval = getattr(request, "kv_decode_interval",
                                                    self.cli_args.kv_decode_interval)  # fmt: skip
        self.prompt_cache.context_tokens = getattr(request, "kv_context", 0)
        # under mlx.launch every rank runs each step: a job stops only by the shared removal
        self.prompt_cache.gone = None if self._is_distributed else _CLIENTS.get(id(request))
        return super()._tokenize(tokenizer, request, args)

    def generate(self, request, generation_args, progress_callback=None):
        _handler.gone, _handler.ctx = _CLIENTS.get(id(request)), None
        try:
            return super().generate(request, generation_args, progress_callback)
        except ClientGone:
            raise
        except Exception as e:
            request.kv_failure = self.answer(e)
            raise request.kv_failure from None

    def unavailable(self) -> Optional[str]:
        """Why the server cannot serve (its generation thread stopped), or None."""
        if self.generation_available():
            return None
        return self.failure or "the generation thread stopped"

    def answer(self, error: Exception) -> Exception:
        """``request_failure``, or a 503 when the generation thread has stopped."""
        why = self.unavailable()
        return request_failure(error) if why is None else RequestFailed(503, why)

    def _await_response(self, response_queue):
        gone = getattr(_handler, "gone", None)
        while True:
            try:
                item = response_queue.get(timeout=0.25)
            except QueueEmpty:
                why = self.unavailable()
                if why is not None:
                    raise RequestFailed(503, why)
                item = _NOTHING  # none may come for a while (a queued sequence): check anyway
            if isinstance(item, GenerationContext):
                _handler.ctx = item
            if gone is not None and _handler.ctx is not None and gone():
                _handler.ctx.stop()
                raise ClientGone()
            if item is not _NOTHING:
                return self.answer(item) if isinstance(item, Exception) else item

    def _serve_single(self, request, stream):
        # mlx-lm's one-request path (a seed, --kv-bits, a model it cannot batch) takes the
        # caches at once: no batch generator runs the compaction
        self.prompt_cache.interleave = False
        try:
            return super()._serve_single(request, stream)
        finally:
            self.prompt_cache.interleave = True

    def kv_stats(self) -> dict:
        batches = list(_LIVE_BATCHES)
        active = sum(b.kv_bytes for b in batches)
        cache = self.prompt_cache
        return {
            "active_sequences": sum(b.sequences for b in batches),
            "compacting_sequences": sum(b.compacting for b in batches),
            "active_bytes": active,
            "prompt_cache_sequences": len(cache),
            "prompt_cache_bytes": cache.nbytes,
            "prompt_cache_lossy_entries": cache.lossy_entries(),
            "bytes_held": active + cache.nbytes,
            "compacted_requests": cache.compacted_requests,
            "compacted_contexts": len(cache.contexts),
            "compacted_context_bytes": cache.context_bytes,
            "refused_prompt_cache_inserts": cache.refused_inserts,
        }


# -- HTTP -----------------------------------------------------------------------------------------
class KVAPIHandler(APIHandler):
    """mlx-lm's handler; adds request checks that answer 4xx, kvfn's usage fields, KV bytes
    in /health and /metrics, and lists the served model in /v1/models."""

    def send_error_json(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def handle_completion(self, request, stop_words):
        try:
            self.kv_prompt = self.check_request(request)
        except LookupError as e:
            return self.send_error_json(404, str(e.args[0]))
        except (ValueError, TypeError) as e:
            return self.send_error_json(400, str(e))
        self.kv_request = request
        _CLIENTS[id(request)] = self.client_gone
        try:
            return super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            # mlx-lm's own write of the stream's headers may fail before it would stop the ctx
            if getattr(_handler, "ctx", None) is not None:
                _handler.ctx.stop()
            logging.info("kvfn-server: the client left; its request was dropped")
        except RequestFailed as e:
            self.send_failure(e)
        finally:
            _CLIENTS.pop(id(request), None)

    def client_gone(self) -> bool:
        """Whether the client has closed its connection (it has nothing more to send, so a
        socket with an end of stream to read is a close; a client that only half-closes after
        its request reads as gone). Called from any thread."""
        try:
            return not self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:  # nothing to read: still connected
            return False
        except (OSError, ValueError):
            return True

    def send_failure(self, failure: RequestFailed) -> None:
        """A request that failed after its response began: a stream's headers went out when
        it started, so it ends with an error event (as OpenAI's streams do); a plain response
        has sent nothing yet, so its buffered 200 headers give way to the failure's status."""
        if self.stream:
            error = {"message": str(failure), "type": "server_error", "code": failure.status}
            self.wfile.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()
            return
        self._headers_buffer = []  # http.server's buffer: the 200 status line, unsent
        self.send_error_json(failure.status, str(failure))

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm answers any failure to start a generation with 404; say what it was
        failure = getattr(getattr(self, "kv_request", None), "kv_failure", None)
        if status_code == 404 and failure is not None:
            status_code = failure.status
        super()._set_completion_headers(status_code)

    def unavailable(self) -> Optional[str]:
        return self.response_generator.unavailable()

    def do_POST(self):
        why = self.unavailable()
        if why is not None:
            return self.send_error_json(503, why)
        return super().do_POST()

    def check_request(self, request) -> list:
        """Checks mlx-lm leaves to the generation thread (or skips); returns the prompt tokens."""
        provider = self.response_generator.model_provider
        try:
            provider.check_model(self.requested_model)
        except ValueError as e:
            raise LookupError(str(e)) from None
        self.requested_model = provider.model_id  # one name: mlx-lm drains its batch on another
        if self.adapter is not None or self.requested_draft_model != "default_model":
            raise ValueError("kvfn-server serves no adapters or draft models")
        self.attach_policy(request)
        args = SimpleNamespace(chat_template_kwargs=self.chat_template_kwargs)
        try:  # mlx-lm's own tokenization (its base method: the subclass's has side effects)
            prompt = ResponseGenerator._tokenize(
                self.response_generator, provider.tokenizer, request, args
            )[0]
        except Exception as e:
            raise ValueError(f"cannot build a prompt from the request: {e}") from None
        if not prompt:
            raise ValueError("the prompt is empty")
        if request.kv_policy is not None:  # it compacts all but the last token
            request.kv_policy.check_prompt(len(prompt) - 1)
        request.kv_context = self.shared_context(request, prompt)
        context = provider.context_length
        if context and len(prompt) + self.max_tokens > context:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                f"model's context of {context} tokens"
            )
        return prompt

    def shared_context(self, request, prompt: list) -> int:
        """How many leading prompt tokens a query-agnostic policy compacts once and reuses
        (rule 5): the body's ``kv_context_tokens``, else, for a chat request whose last message
        is the user's, everything before that message's text; 0: none."""
        policy, given = request.kv_policy, self.body.get("kv_context_tokens")
        if given is not None:
            if type(given) is not int or not 2 <= given < len(prompt):
                raise ValueError(f"kv_context_tokens must be an int in [2, {len(prompt)}) (the "
                                 f"prompt's tokens), got {given!r}")  # fmt: skip
            if policy is None or not policy.query_agnostic:
                name = "none" if policy is None else policy.name
                raise ValueError(f"kv_context_tokens: kv_eviction {name!r} is not query-agnostic "
                                 "(its rows depend on the question), so no context is reused")  # fmt: skip
            return given
        messages = getattr(request, "messages", None)
        if policy is None or not policy.query_agnostic or request.request_type != "chat":
            return 0
        if len(messages) < 2 or messages[-1].get("role") != "user":
            return 0
        provider = self.response_generator.model_provider
        tokenizer = provider.tokenizer
        if not tokenizer.has_chat_template:
            return 0
        kwargs = {**provider.cli_args.chat_template_args, **(self.chat_template_kwargs or {})}
        head = tokenizer.apply_chat_template([*messages[:-1], {"role": "user", "content": ""}],
                                             add_generation_prompt=False, tokenize=True,
                                             tools=request.tools, **kwargs)  # fmt: skip
        n = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), len(head))
        return n if 2 <= n < len(prompt) else 0

    def attach_policy(self, request) -> None:
        """The body's ``kv_eviction`` / ``kv_budget`` (optional) over the server's flags."""
        cli = self.response_generator.cli_args
        name = self.body.get("kv_eviction", cli.kv_eviction)
        budget = self.body.get("kv_budget", cli.kv_budget)
        if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
            raise ValueError(f"kv_budget must be a positive integer, got {budget!r}")
        if cli.policy is None and name != "none":
            raise ValueError(
                f"kv_eviction {name!r}: this server runs without eviction (--kv-eviction none)"
            )
        policy = flags.make_policy(name, budget, cli.kv_window, cli.kv_sink_tokens,
                                   cli.kv_min_tokens, cli.duo)  # fmt: skip
        provider = self.response_generator.model_provider
        own = head_parts_of(policy, provider.functional_model())
        ragged = policy is not None and policy.ragged
        if (
            (own is not None and own != provider.head_parts)
            or ragged != provider.ragged
            and (ragged or provider.head_parts is not None)
        ):
            raise ValueError(
                f"kv_eviction {name!r} keeps per-head rows in its own head parts; this server "
                f"(--kv-eviction {cli.kv_eviction}) cannot batch them: start one with it"
            )
        request.kv_policy = self.kv_policy_used = policy
        request.kv_max_rows = self.max_rows_of(policy)
        request.kv_probe = self.probe_of(policy, request.kv_max_rows)
        request.kv_decode_interval = self.kv_decode_interval = self.decode_interval_of(policy)

    def max_rows_of(self, policy):
        """The body's ``kv_max_rows``, else the server's ``--kv-max-rows`` (``setting_of``)."""
        check = lambda rows: self.check_max_rows(policy, rows)  # noqa: E731
        return self.setting_of(policy, "kv_max_rows", check)

    def check_max_rows(self, policy, rows) -> None:
        """Refuses, by name and reason, a cap that ``policy`` cannot take."""
        step = self.response_generator.cli_args.prefill_step_size
        sliding = self.response_generator.model_provider.functional_model().sliding_windows
        check_bounded(sliding, policy, rows, step)

    def probe_of(self, policy, max_rows) -> bool:
        """The body's ``kv_probe``, else the server's ``--kv-probe`` (``setting_of``)."""

        cli = self.response_generator.cli_args

        def check(probe):
            if type(probe) is not bool:
                raise ValueError(f"kv_probe must be true or false, got {probe!r}")
            if probe and max_rows is None:
                if cli.kv_max_rows is not None and "kv_max_rows" not in self.body:
                    self.check_max_rows(policy, cli.kv_max_rows)  # why the flag's cap fell
                raise ValueError("kv_probe scores the compactions while prefilling: it needs "
                                 "kv_max_rows (or --kv-max-rows)")  # fmt: skip
            check_probe(policy, probe)

        if self.body.get("kv_probe", True) is False:  # off needs no policy
            return False
        return bool(self.setting_of(policy, "kv_probe", check))

    def decode_interval_of(self, policy):
        """The body's ``kv_decode_interval``, else the server's ``--kv-decode-interval``."""
        sliding = self.response_generator.model_provider.functional_model().sliding_windows
        check = lambda interval: check_generating(policy, interval, sliding)  # noqa: E731
        return self.setting_of(policy, "kv_decode_interval", check)

    def setting_of(self, policy, field: str, check):
        """The body's ``field`` (optional; null: none), ``check``ed; else the server's flag of
        that name where the request's policy (and budget) can take it, else none."""
        flag = getattr(self.response_generator.cli_args, field)
        if field not in self.body:
            if flag is None or policy is None:
                return None
            try:
                check(flag)
            except ValueError:  # a policy (or a budget) of the request's own that cannot
                return None
            return flag
        value = self.body[field]
        if value is None:
            return None
        if policy is None:
            raise ValueError(f"{field} needs a kv_eviction policy")
        check(value)
        return value

    def kv_usage(self, usage: dict) -> dict:
        policy = getattr(self, "kv_policy_used", None)
        info = self.response_generator.prompt_cache.evictions.get((policy, tuple(self.kv_prompt)))
        if info is not None:
            usage["kv_eviction"] = dict(info)
            interval = getattr(self, "kv_decode_interval", None)
            if interval is not None:
                usage["kv_eviction"]["decode_interval"] = interval
            if not info["kept_whole"]:
                # mlx-lm counts the compacted prompt as cached: only a reused context's rows
                # are (its last token is prefilled again, with the rest)
                cached = info["context_tokens"] - 1 if info.get("reused") else 0
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def handle_chat_completions(self):
        messages = self.body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            raise ValueError(
                f"messages must be a non-empty list of objects with a role, got {messages!r:.80}"
            )
        return super().handle_chat_completions()

    def handle_text_completions(self):
        prompt = self.body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {prompt!r:.80}")
        return super().handle_text_completions()

    def generate_response(self, *args, **kwargs):
        response = super().generate_response(*args, **kwargs)
        if "usage" in response:
            self.kv_usage(response["usage"])
        return response

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        self.kv_usage(response["usage"])
        return response

    def do_GET(self):
        why = self.unavailable()
        if why is not None and self.path != "/health":
            return self.send_json(
                503, {"error": why, "kv_cache": self.response_generator.kv_stats()}
            )
        if self.path == "/metrics":
            return self.send_json(200, self.response_generator.kv_stats())
        return super().do_GET()

    def send_json(self, status: int, body: dict) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps(body).encode())
        self.wfile.flush()

    def handle_health_check(self):
        healthy = self.response_generator.is_healthy
        cli = self.response_generator.cli_args
        body = {"status": "ok" if healthy else "unavailable"}
        if not healthy:
            body["error"] = self.unavailable()
        body["kv_cache"] = self.response_generator.kv_stats()
        body["kv_eviction"] = cli.kv_eviction
        if cli.policy is not None:
            body["kv_settings"] = {"budget": cli.kv_budget, "window": cli.kv_window,
                                   "sink_tokens": cli.kv_sink_tokens,
                                   "min_tokens": cli.kv_min_tokens,
                                   "max_rows": cli.kv_max_rows, "probe": cli.kv_probe,
                                   "decode_interval": cli.kv_decode_interval}  # fmt: skip
            if cli.duo is not None:
                policy = cli.policy
                heads = [x for row in policy.heads for x in row]
                body["kv_settings"].update(head_pattern=cli.kv_head_pattern,
                                           retrieval_heads=f"{sum(heads)}/{len(heads)}",
                                           sink_tokens=policy.sink_tokens, recent=policy.recent)  # fmt: skip
        self.send_json(200 if healthy else 503, body)

    def handle_models_request(self):
        # mlx-lm lists its Hugging Face cache; this server serves exactly one model.
        model_id = self.response_generator.model_provider.model_id
        self.send_json(200, {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": self.created, "owned_by": "kvfn"}
        ]})  # fmt: skip


# -- startup ------------------------------------------------------------------------------------
def make_generator(args) -> KVResponseGenerator:
    """The generation thread, started, with the model loaded (sharded under mlx.launch)."""
    provider = KVModelProvider(args)
    try:
        provider.load("default_model")
    except (FileNotFoundError, ValueError, OSError) as e:
        raise SystemExit(f"error: --model {args.model}: {e}")
    # mlx-lm's generation loop builds its BatchGenerator by this module-level name.
    mlx_server.BatchGenerator = TrackedBatchGenerator
    return KVResponseGenerator(provider, EvictingPromptCache(provider, args.prompt_cache_size))


WARM_UP_TOKENS = 32768  # the longest warm-up prompt where the model does not say its context
WARM_UP_DECODE = 4  # the tokens the warm-up decodes past its decode interval's, if any


def warm_up_tokens(policy, longest: int, max_rows: Optional[int], step: int) -> int:
    """The warm-up prompt's length: the shortest power of two (from 64) that ``policy``
    compacts; under a cap (``max_rows``), long enough that two chunks of ``step`` pass it before
    the last chunk, so the first compaction while prefilling and a steady one (the cap plus a
    chunk, back to the cap) are both built, where a prompt the model takes can pass the cap; at
    most ``longest``."""
    n = 64
    while policy.keeps_whole(n - 1):
        n *= 2
    passed = None if max_rows is None else (max_rows // step + 1) * step  # the cap's first pass
    if passed is not None and passed < longest - 1:
        # that chunk, a whole one more, and a last one holding the observation window
        # (``bounded_chunks``), so the steady compaction makes room for a whole chunk
        n = max(n, passed + 2 * step + policy.window + 1)
    return min(n, longest)


def warm_up(generator, args) -> Optional[tuple]:
    """One request of the server's policy through the generation thread: a synthetic prompt the
    policy compacts (``warm_up_tokens``), and a few decoded tokens; under
    ``--kv-decode-interval N``, N more with the end of text banned, so the first compaction
    while generating is built too. (prompt tokens, decoded tokens, seconds), or None without a
    policy or where it keeps every prompt the model takes whole."""
    policy = args.policy
    longest = generator.model_provider.context_length or WARM_UP_TOKENS
    if policy is None or policy.keeps_whole(longest - 1):
        return None
    n = warm_up_tokens(policy, longest, args.kv_max_rows, args.prefill_step_size)
    tokenizer = generator.model_provider.tokenizer
    words = " ".join(f"warm up {i % 97}" for i in range(n))
    prompt = tokenizer.decode(tokenizer.encode(words)[:n])
    interval = args.kv_decode_interval
    # the cache compacts once its rows reach the budget plus the interval: the prompt's kept
    # rows, its last token and interval - 1 decoded ones; a few more decode after it
    decode = WARM_UP_DECODE + (interval or 0)
    ban = None if interval is None else {t: -1e9 for t in tokenizer.eos_token_ids}
    request = mlx_server.CompletionRequest("text", prompt, [], None, None)
    settings = mlx_server.GenerationArguments(
        model=mlx_server.ModelDescription("default_model", None, None),
        sampling=mlx_server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.0),
        logits=mlx_server.LogitsProcessorArguments(ban, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=decode, num_draft_tokens=0, logprobs=False, top_logprobs=0,
        seed=None, chat_template_kwargs=None,
    )  # fmt: skip
    tic = time.perf_counter()
    ctx, responses = generator.generate(request, settings)
    decoded = sum(1 for _ in responses)
    generator.prompt_cache.compacted_requests = 0
    return len(ctx.prompt), decoded, time.perf_counter() - tic


def make_server(args) -> tuple:
    """(HTTP server, response generator) with the model loaded; the port is bound."""
    generator = make_generator(args)
    # mlx-lm's _run_http_server neither takes a handler class from run() nor reports the port
    # it bound, which a server on --port 0 must print.
    family, _, _, _, address = socket.getaddrinfo(
        args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    ThreadingHTTPServer.address_family = family
    fingerprint = mlx_server.get_system_fingerprint()
    httpd = ThreadingHTTPServer(
        address,
        lambda *a, **k: KVAPIHandler(generator, *a, system_fingerprint=fingerprint, **k),
    )
    return httpd, generator


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(message)s")
    if mx.distributed.init().rank() != 0:
        # under mlx.launch rank 0 serves HTTP; the others run each request it shares with them
        return make_generator(args).join()
    httpd, generator = make_server(args)
    warm = args.kv_warmup
    if warm is None:
        warm = mx.default_device() == mx.gpu
    done = warm_up(generator, args) if warm else None
    if done is not None:
        tokens, decoded, seconds = done
        print(f"kvfn-server warmed up {args.kv_eviction} in {seconds:.1f} s (a {tokens}-token "
              f"prompt, {decoded} tokens decoded; --no-kv-warmup skips it)", flush=True)  # fmt: skip
    host, port = httpd.server_address[:2]
    print(f"kvfn-server listening on http://{host}:{port} (kv-eviction {args.kv_eviction})",
          flush=True)  # fmt: skip
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()


if __name__ == "__main__":
    main(sys.argv[1:])
