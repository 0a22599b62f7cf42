"""The ``--kv-*`` flags of kvfn's programs (``examples/generate.py``, ``kvfn-server``) and the
policy they name: one flag group and one reading of it, so both take and refuse alike."""

import argparse
import math
from typing import Optional

from ..compaction import check_probe
from ..decoding import check_generating
from ..policies.duo import HeadPattern
from ..policies.policy import POLICIES, BasePolicy, parse_policy


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**64), got {value}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


BUDGET = 512  # --kv-budget's default


def add_arguments(parser: argparse.ArgumentParser, eviction_help: str) -> None:
    """The eviction flags (off unless ``--kv-eviction`` names a policy) and DuoAttention's."""
    kv = parser.add_argument_group("KV-cache eviction (off unless --kv-eviction names a policy)")
    kv.add_argument("--kv-eviction", default="none", help=eviction_help)
    kv.add_argument("--kv-budget", type=positive_int,
                    help=f"rows kept per layer and head (default {BUDGET}, or --kv-max-rows "
                    "where that is lower)")  # fmt: skip
    kv.add_argument("--kv-window", type=positive_int, default=32,
                    help="observation window (recent rows)")  # fmt: skip
    kv.add_argument("--kv-sink-tokens", type=non_negative_int, default=4)
    kv.add_argument("--kv-min-tokens", type=non_negative_int, default=0,
                    help="prompts this short are never compacted")  # fmt: skip
    kv.add_argument("--kv-max-rows", type=positive_int, metavar="R",
                    help="evict while prefilling: hold at most R rows a head (plus one prefill "
                    "chunk; --kv-probe: and its window) at any moment, however long the prompt "
                    "(kvfn.compact's max_rows)")  # fmt: skip
    kv.add_argument("--kv-probe", action="store_true",
                    help="with --kv-max-rows: score each compaction while prefilling by the "
                    "prompt's last window (its question), not the chunk's last queries "
                    "(kvfn.compact's probe)")  # fmt: skip
    kv.add_argument("--kv-decode-interval", type=positive_int, metavar="N",
                    help="evict while generating: every N generated tokens compact back to "
                    "--kv-budget (at most budget + N rows a head; kvfn.bounded_decode's)")  # fmt: skip
    duo = parser.add_argument_group(
        "DuoAttention (--kv-eviction duo; duo-snapkv compresses retrieval heads to --kv-budget)"
    )
    duo.add_argument("--kv-head-pattern",
                     help="a DuoAttention pattern folder or .tsv (make one with `kvfn heads`)")  # fmt: skip
    duo.add_argument("--kv-retrieval-ratio", type=probability,
                     help="fraction of KV heads that keep the long context (default: the "
                     "pattern's config.json sparsity or threshold, else 0.5)")  # fmt: skip
    duo.add_argument("--kv-sink-size", type=non_negative_int,
                     help="streaming heads' sink rows (default: the pattern's)")  # fmt: skip
    duo.add_argument("--kv-recent-size", type=positive_int,
                     help="streaming heads' recent rows (default: the pattern's)")  # fmt: skip


DUO_FLAGS = ("kv_head_pattern", "kv_retrieval_ratio", "kv_sink_size", "kv_recent_size")


def takes_pattern(cls) -> bool:
    """Whether a policy class takes a DuoAttention head pattern."""
    return "pattern" in cls.settings()


def head_pattern_settings(args: argparse.Namespace) -> Optional[dict]:
    """A DuoAttention policy's settings from the flags (None without --kv-head-pattern)."""
    if args.kv_head_pattern is None:
        return None
    pattern = HeadPattern.load(args.kv_head_pattern)
    return dict(
        pattern=pattern,
        ratio=None if args.kv_retrieval_ratio is None else round(100 * args.kv_retrieval_ratio),
        sink_tokens=pattern.sink_size if args.kv_sink_size is None else args.kv_sink_size,
        recent=args.kv_recent_size or pattern.recent_size,
    )


def make_policy(name: str, budget: int, window: int, sink_tokens: int, min_tokens: int,
                duo: Optional[dict] = None) -> Optional[BasePolicy]:  # fmt: skip
    """The policy for a ``--kv-eviction`` name (None for "none"); ``duo``: a DuoAttention
    policy's settings (``head_pattern_settings``). A ValueError names a bad value."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"kv_eviction must be a policy name or 'none', got {name!r}")
    if name == "none":
        return None
    if budget < sink_tokens + window:
        raise ValueError(
            f"kv budget {budget} is below sink tokens + window = {sink_tokens} + {window}"
        )
    settings = dict(budget=budget, window=window, sink_tokens=sink_tokens, min_tokens=min_tokens)
    cls = POLICIES.get(name.split("-")[0])
    if cls is not None:  # a policy without a window (or sinks) takes only its own settings
        settings = {k: v for k, v in settings.items() if k in cls.settings()}
    if cls is not None and takes_pattern(cls):
        if not duo:
            raise ValueError(f"{cls.name} needs a head pattern: start with --kv-head-pattern "
                             "DIR (make one with `kvfn heads`)")  # fmt: skip
        settings.update(duo)
    policy = parse_policy(name, **settings)
    getattr(policy, "heads", None)  # a pattern that does not fit says so now
    return policy


def read(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Sets ``args.duo`` (``head_pattern_settings``) and ``args.policy`` (None for "none")
    from the flags; a bad one exits through ``parser.error``, named."""
    args.duo = args.policy = None
    if args.kv_budget is None:
        args.kv_budget = min(BUDGET, args.kv_max_rows or BUDGET)
    if not args.kv_eviction:
        parser.error("argument --kv-eviction: must be a policy name or 'none', got ''")
    cls = POLICIES.get(args.kv_eviction.split("-")[0])
    for flag in DUO_FLAGS:  # None unless given
        if getattr(args, flag) is not None and not (cls and takes_pattern(cls)):
            name = "--" + flag.replace("_", "-")
            parser.error(f"argument {name}: needs --kv-eviction duo, got {args.kv_eviction}")
    if args.kv_probe and args.kv_max_rows is None:
        parser.error("argument --kv-probe: needs --kv-max-rows R")
    if args.kv_eviction == "none":
        for flag in ("kv_max_rows", "kv_decode_interval"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                parser.error(f"argument {name}: needs --kv-eviction POLICY")
        return
    if args.kv_budget < args.kv_sink_tokens + args.kv_window:
        parser.error(
            f"argument --kv-budget: {args.kv_budget} is below --kv-sink-tokens + --kv-window = "
            f"{args.kv_sink_tokens} + {args.kv_window}"
        )
    try:
        args.duo = head_pattern_settings(args)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"argument --kv-head-pattern: {e}")
    try:
        args.policy = make_policy(args.kv_eviction, args.kv_budget, args.kv_window,
                                  args.kv_sink_tokens, args.kv_min_tokens, args.duo)  # fmt: skip
    except ValueError as e:
        parser.error(f"argument --kv-eviction {args.kv_eviction}: {e}")
    if args.kv_max_rows is not None:
        try:
            args.policy.check_max_rows(args.kv_max_rows)
        except ValueError as e:
            parser.error(f"argument --kv-max-rows: {e}")
        try:
            check_probe(args.policy, args.kv_probe)
        except ValueError as e:
            parser.error(f"argument --kv-probe: {e}")
    if args.kv_decode_interval is not None:
        try:
            check_generating(args.policy, args.kv_decode_interval)
        except ValueError as e:
            parser.error(f"argument --kv-decode-interval: {e}")
