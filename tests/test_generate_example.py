import mlx.core as mx
import pytest

import kvfn
from examples import generate


def test_example_runs_end_to_end(capsys):
    report = generate.main(["--context-tokens", "120", "--max-tokens", "5", "--quiet"])
    assert report["prompt_tokens"] > 120
    assert report["generated_tokens"] == 5 and report["text"]
    assert report["prefill_tokens_per_s"] > 0 and report["decode_tokens_per_s"] > 0
    assert report["peak_memory_gb"] > 0
    out = capsys.readouterr()
    assert "prompt_tokens:" in out.out and "prefill" in out.err


def test_example_reads_prompt_from_stdin(monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?"))
    report = generate.main(["--prompt-file", "-", "--max-tokens", "8", "--quiet"])
    assert "Paris" in report["text"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-tokens", "0"], "--max-tokens: must be a positive integer, got 0"),
        (["--temp", "-1"], "--temp: must be >= 0, got -1.0"),
        (["--top-p", "1.5"], "--top-p: must be in [0, 1], got 1.5"),
        (["--top-k", "-3"], "--top-k: must be >= 0, got -3"),
        (["--temp", "nan"], "--temp: must be a finite number, got nan"),
        (["--temp", "inf"], "--temp: must be a finite number, got inf"),
        (["--seed", "-1"], "--seed: must be an integer in [0, 2**64), got -1"),
        (
            ["--kv-retrieval-ratio", "0.3"],
            "--kv-retrieval-ratio: needs --kv-eviction duo, got none",
        ),
        (
            ["--kv-eviction", "snapkv", "--kv-recent-size", "8"],
            "--kv-recent-size: needs --kv-eviction duo, got snapkv",
        ),
        (
            ["--kv-eviction", "snapkv", "--kv-sink-size", "8"],
            "--kv-sink-size: needs --kv-eviction duo, got snapkv",
        ),
        (["--prompt", "x", "--prompt-file", "y"], "not allowed with argument"),
    ],
)
def test_example_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(argv)
    assert message in capsys.readouterr().err


def test_example_rejects_missing_files(tmp_path):
    with pytest.raises(SystemExit, match="--prompt-file .*no such file"):
        generate.main(["--prompt-file", str(tmp_path / "nope.txt")])
    with pytest.raises(SystemExit, match="--model: no such model file"):
        generate.main(["--model", str(tmp_path / "nope.gguf"), "--prompt", "hi"])


@pytest.mark.parametrize(
    "prompt, flags, message",
    [
        ("", [], "prompt tokens: 0; generating needs at least 1"),
        (
            "",
            ["--kv-eviction", "snapkv"],
            "prompt tokens: 0; --kv-eviction snapkv needs at least 2",
        ),
        (
            "hi",
            ["--kv-eviction", "snapkv"],
            "prompt tokens: 1; --kv-eviction snapkv needs at least 2",
        ),
    ],
)
def test_example_rejects_a_prompt_too_short(prompt, flags, message):
    with pytest.raises(SystemExit, match=message):
        generate.main(["--prompt", prompt, "--no-chat-template", *flags])


def test_example_compacts_with_snapkv(capsys):
    report = generate.main(["--context-tokens", "300", "--max-tokens", "4", "--quiet",
                            "--kv-eviction", "snapkv", "--kv-budget", "64", "--kv-window", "8"])  # fmt: skip
    rows_after, rows_before = map(int, report["kv_rows_kept"].split(" / "))
    assert rows_after == 30 * 64 and rows_before == 30 * (report["prompt_tokens"] - 1)  # per layer
    assert report["generated_tokens"] == 4
    assert "kv_bytes:" in capsys.readouterr().out


def test_example_evicts_while_prefilling_and_prints_its_peak(capsys):
    report = generate.main(["--context-tokens", "300", "--max-tokens", "4", "--quiet",
                            "--kv-eviction", "snapkv", "--kv-budget", "64", "--kv-window", "8",
                            "--kv-max-rows", "96", "--prefill-step-size", "64"])  # fmt: skip
    assert report["kv_peak_rows"] <= 96 + 64 + 8 < report["prompt_tokens"]
    assert report["kv_rows_kept"].startswith(f"{30 * 64} / ")
    out = capsys.readouterr().out
    assert "kv_peak_rows:" in out and "peak_memory_gb:" in out


def test_a_cap_below_the_default_budget_is_the_budget():
    """``--kv-max-rows R`` without ``--kv-budget``: the budget is 512, or R where R is lower
    (the issue's ``--kv-max-rows 256`` runs); a budget given above the cap is refused."""
    assert (
        generate.parse_args(["--kv-eviction", "snapkv", "--kv-max-rows", "256"]).policy.budget
        == 256
    )
    assert (
        generate.parse_args(["--kv-eviction", "snapkv", "--kv-max-rows", "900"]).policy.budget
        == 512
    )
    assert generate.parse_args(["--kv-eviction", "snapkv"]).policy.budget == 512


def test_example_refuses_a_policy_that_cannot_evict_while_prefilling(capsys):
    for argv, message in (
        (["--kv-eviction", "pyramidkv", "--kv-max-rows", "600"],
         "--kv-max-rows: pyramidkv cannot evict while prefilling: its layers"),
        (["--kv-eviction", "snapkv", "--kv-budget", "512", "--kv-max-rows", "100"],
         "--kv-max-rows: max_rows must be an int >= the policy's budget 512, got 100"),
        (["--kv-max-rows", "96"], "--kv-max-rows: needs --kv-eviction POLICY"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            generate.parse_args(argv)
        assert message in capsys.readouterr().err


def test_example_evicts_while_generating(capsys):
    report = generate.main(["--context-tokens", "200", "--max-tokens", "40", "--quiet",
                            "--kv-eviction", "snapkv", "--kv-budget", "64", "--kv-window", "8",
                            "--kv-decode-interval", "16"])  # fmt: skip
    assert report["decoder"] == "kvfn (bounded_decode)"
    assert report["kv_decode_rows_held_at_most"] == 80 and report["generated_tokens"] >= 1
    for argv, message in (
        (["--kv-eviction", "kvzip", "--kv-decode-interval", "64"],
         "--kv-decode-interval: kvzip cannot evict while generating"),
        (["--kv-eviction", "snapkv", "--kv-decode-interval", "8", "--kv-window", "8",
          "--kv-budget", "64"], "--kv-decode-interval: interval must be an int > the policy's window 8, got 8"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            generate.parse_args(argv)
        assert message in capsys.readouterr().err


def test_example_rejects_a_budget_below_sinks_and_window(capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(["--kv-eviction", "snapkv", "--kv-budget", "10", "--kv-window", "8"])
    assert (
        "--kv-budget: 10 is below --kv-sink-tokens + --kv-window = 4 + 8" in capsys.readouterr().err
    )


def test_example_runs_duo_from_a_pattern_folder(tmp_path, capsys):
    import numpy as np

    import kvfn

    scores = np.random.default_rng(0).random((30, 3))
    kvfn.HeadPattern(scores=scores, sink_size=8, recent_size=32).save(tmp_path)
    report = generate.main(["--context-tokens", "300", "--max-tokens", "4", "--quiet",
                            "--kv-eviction", "duo", "--kv-head-pattern", str(tmp_path),
                            "--kv-retrieval-ratio", "0.25"])  # fmt: skip
    rows_after, rows_before = map(int, report["kv_rows_kept"].split(" / "))
    P = report["prompt_tokens"] - 1
    # a quarter of the 90 KV heads (22) keep all P rows, the rest 8 + 32; reported as the
    # per-head mean of each layer (3 KV heads), summed over layers
    k = round(0.25 * 90)
    assert abs(rows_after - (k * P + (90 - k) * 40) / 3) <= 30
    # each layer holding retrieval and streaming heads decodes from one slots buffer
    assert report["generated_tokens"] >= 1 and "slots" in report["decoder"]
    with pytest.raises(SystemExit):
        generate.parse_args(["--kv-eviction", "duo"])
    assert "head pattern" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        generate.parse_args(["--kv-eviction", "snapkv", "--kv-head-pattern", str(tmp_path)])
    assert "--kv-head-pattern: needs --kv-eviction duo, got snapkv" in capsys.readouterr().err


def test_generate_and_the_server_read_the_eviction_flags_alike():
    from kvfn.serving.server import parse_args as server_args

    flags = ["--kv-eviction", "snapkv", "--kv-budget", "64", "--kv-window", "8",
             "--kv-sink-tokens", "2", "--kv-min-tokens", "100"]  # fmt: skip
    g, s = generate.parse_args(flags), server_args(flags)
    kv = {k: v for k, v in vars(g).items() if k.startswith("kv_")}  # and its decode interval
    assert kv.pop("kv_decode_interval") is None
    assert len(kv) == 11 and kv == {k: getattr(s, k) for k in kv}
    assert g.policy == s.policy == kvfn.SnapKV(budget=64, window=8, sink_tokens=2, min_tokens=100)


class _Detokenizer:
    def __init__(self, on_token=None):
        self.on_token = on_token

    def reset(self):
        self.ids, self.last_segment = [], ""

    def add_token(self, t):
        if self.on_token:
            self.on_token(len(self.ids))
        self.ids.append(t)
        self.last_segment = f"<{t}>"

    def finalize(self):
        self.last_segment = ""


@pytest.fixture(scope="module")
def compacted_tiny():
    from tests.tiny import tiny_model

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    prompt = [int(t) for t in mx.random.randint(0, 97, (40,), key=mx.random.key(3)).tolist()]
    states, _ = kvfn.compact(fm, prompt, kvfn.SnapKV(budget=16, window=4, sink_tokens=2),
                             max_new_tokens=6)  # fmt: skip
    return fm, states, prompt[-1]


def _hot(logits):  # sampled, so the tokens vary (the tiny model's greedy tokens repeat)
    return mx.random.categorical(logits * 0.01)


@pytest.mark.parametrize("max_tokens", [1, 6])
@pytest.mark.parametrize("eos_at", [None, 0, 2, 5])
def test_kvfn_stream_is_pipelined_and_gives_the_synchronous_tokens(compacted_tiny, max_tokens,
                                                                   eos_at):  # fmt: skip
    from types import SimpleNamespace

    fm, states, last = compacted_tiny
    mx.random.seed(7)
    want, token, s = [], mx.array([[last]]), states
    for _ in range(max_tokens):  # synchronous: one step, then read its token
        logits, s = fm.decode(token, s)
        token = _hot(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[:, None]
        want.append(token.item())
    assert max_tokens == 1 or len(set(want)) > 2, want
    eos = {want[eos_at]} if eos_at is not None and eos_at < max_tokens else set()
    stop = want.index(next(iter(eos))) if eos else max_tokens
    calls, steps_when_read = [], []
    counted = SimpleNamespace(decode=lambda *a: calls.append(1) or fm.decode(*a))
    tokenizer = SimpleNamespace(detokenizer=_Detokenizer(lambda k: steps_when_read.append(len(calls))),
                                eos_token_ids=eos)  # fmt: skip
    mx.random.seed(7)
    args = SimpleNamespace(max_tokens=max_tokens)
    pieces = list(generate.kvfn_stream(counted, tokenizer, states, last, args, _hot))
    assert tokenizer.detokenizer.ids == want[:stop]
    assert pieces[-1][1]["generated_tokens"] == min(stop + 1, max_tokens)
    # token k was read with step k + 1 already queued, and no step past max_tokens was built
    assert steps_when_read == [min(k + 2, max_tokens) for k in range(stop)]
    assert len(calls) == min(stop + 2, max_tokens)
