import argparse
import functools
import re

import mlx.core as mx
import pytest

import kvfn
from examples import benchmark_decode


def test_benchmark_prints_kvfn_and_mlx_lm_side_by_side(capsys, tmp_path):
    result = benchmark_decode.main(["--shape", "tiny", "--lengths", "96", "--budgets", "48",
                                    "--chunks", "32", "--steps", "2",
                                    "--json", str(tmp_path / "b.json")])  # fmt: skip
    (pre,) = result["prefill"]
    assert pre["L"] == 96 and pre["chunk"] == 32
    assert pre["time_ratio"] == pytest.approx(pre["kvfn_s"] / pre["mlx_s"])
    assert pre["expected_s"] > 0 and pre["expected_gb"] > 0  # Expected Attention's prefill
    assert pre["kvzip_s"] > 0 and pre["kvzip_gb"] > 0  # KVzip's: the prefill and its own pass
    (ev,) = result["evict"]
    assert ev["traced_ms"] > 0 and ev["eager_ms"] > 0
    (row,) = result["decode"]
    assert row["L"] == 96 and row["R"] == 48
    rounds = row["rounds_ms"]
    assert all(len(ms) == 3 for ms in rounds.values())  # --rounds' default
    expected = {"kvfn_R_vs_mlx_R": ("kvfn_R", "mlx_R"),
                "kvfn_full_vs_mlx_full": ("kvfn_full", "mlx_full"),
                "speedup_kvfn": ("mlx_full", "kvfn_R"),
                "speedup_interop": ("mlx_full", "interop_R"),
                "mlx_ceiling": ("mlx_full", "floor"),
                "kvfn_vs_mlx_pipelined": ("kvfn_R_piped", "mlx_R_piped"),
                "floor_vs_mlx_R": ("floor", "mlx_R"),
                "kvfn_R_vs_floor": ("kvfn_R", "floor")}  # fmt: skip
    for name, (a, b) in expected.items():
        ratios = sorted(x / y for x, y in zip(rounds[a], rounds[b]))  # each round's own
        assert row[name] == pytest.approx(ratios[1])
        assert row[name + "_range"] == pytest.approx([ratios[0], ratios[-1]])
    assert row["kvfn_R_ms"] == pytest.approx(sorted(rounds["kvfn_R"])[1])
    assert row["mlx_floor_ms"] == pytest.approx(sorted(rounds["floor"])[1])
    # 8 layers x 4 KV heads x (2 x 64 float32 + an int32 position) bytes a row
    per_row = 8 * 4 * (2 * 64 * 4 + 4)
    assert row["kept_kv_mb"] * 1e6 == pytest.approx(48 * per_row)
    assert row["full_kv_mb"] * 1e6 == pytest.approx(95 * per_row)
    w = result["weights_gb"] * 1e3
    assert row["byte_bound"] == pytest.approx((w + row["full_kv_mb"]) / (w + row["kept_kv_mb"]))
    out = capsys.readouterr().out
    assert (
        "kvfn R / mlx R" in out
        and "memory ratio" in out
        and "kvfn expected" in out
        and "compiled compact_states" in out
        and "MLX ceiling" in out
        and "floor / mlx R" in out
    )
    assert (tmp_path / "b.json").stat().st_size > 100


def test_rounds_alternate_their_order_and_ratios_pair_within_a_round():
    calls, ticks = [], iter(range(1, 100))

    def timer(name):
        return lambda: calls.append(name) or next(ticks)

    times = benchmark_decode.in_rounds({n: timer(n) for n in "abc"}, 3)
    assert calls == list("abc" "cba" "abc")
    assert times == {"a": [1, 6, 7], "b": [2, 5, 8], "c": [3, 4, 9]}
    # a / c by round: 1/3, 6/4, 7/9; a ratio of medians would give 6/4
    assert benchmark_decode.paired(times, "a", "c") == pytest.approx((7 / 9, 1 / 3, 6 / 4))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "8"], "--budgets: values must be >= 40, got [8]"),
        (["--q4"], "--q4: needs --shape"),
        (["--shape", "huge"], "invalid choice: 'huge'"),
    ],
)
def test_benchmark_rejects_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark_decode.main(argv)
    assert message in capsys.readouterr().err


def test_benchmark_prefill_variants_leave_the_others_out(capsys):
    result = benchmark_decode.main(["--shape", "tiny", "--lengths", "96", "--chunks", "32",
                                    "--tables", "prefill", "--prefill-variants", "plain"])  # fmt: skip
    (pre,) = result["prefill"]
    assert pre["plain_s"] > 0 and not {"stock_s", "kvzip_s", "expected_s"} & set(pre)
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 96 | 32 |")]
    assert line.endswith(" | - | - | - |") and not line.endswith("| - | - | - | - |")


def test_profile_decode_counts_a_steps_primitives(capsys):
    """A decode step over a packed state writes keys and values, one scatter each a layer, and
    no position (the slots past ``rows`` already hold them); mlx-lm writes at static slices."""
    from examples import profile_decode
    from examples.benchmark_decode import SHAPES

    (counts,) = profile_decode.main(["--shape", "tiny", "--lengths", "64", "--primitives"]).values()
    layers = SHAPES["tiny"]["num_hidden_layers"]
    assert counts["kvfn packed"]["ScatterAxis"] == 2 * layers
    assert counts["mlx-lm"]["ScatterAxis"] == 0 and sum(counts["mlx-lm"].values()) > 0
    assert "kvfn packed" in capsys.readouterr().out


def test_profile_decode_q4_quantizes_the_steps_weights():
    from examples import profile_decode

    argv = ["--shape", "tiny", "--lengths", "64", "--primitives"]
    (q4,) = profile_decode.main(argv + ["--q4"]).values()
    (plain,) = profile_decode.main(argv).values()
    assert q4["kvfn packed"]["QuantizedMatmul"] == q4["mlx-lm"]["QuantizedMatmul"] > 0
    assert plain["kvfn packed"]["QuantizedMatmul"] == plain["mlx-lm"]["QuantizedMatmul"] == 0


def test_profile_decode_pairs_each_rows_ratio_to_mlx_lm_within_a_round(capsys):
    from examples import profile_decode

    timed = profile_decode.main(["--shape", "tiny", "--lengths", "64", "--rounds", "3",
                                 "--steps", "2"])  # fmt: skip
    assert set(timed) == {(64, "mlx-lm"), (64, "kvfn"), (64, "kvfn masked SDPA")}
    mlx = timed[64, "mlx-lm"]["rounds_ms"]
    for name in ("kvfn", "kvfn masked SDPA"):
        row = timed[64, name]
        for mode in ("sync", "piped"):
            ratios = sorted(a / b for a, b in zip(row["rounds_ms"][mode], mlx[mode]))
            assert row[mode + "_vs_mlx_lm"] == pytest.approx(ratios[1])
            assert row[mode + "_vs_mlx_lm_range"] == pytest.approx([ratios[0], ratios[2]])
        assert row["ms"]["sync"] == pytest.approx(sorted(row["rounds_ms"]["sync"])[1])
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if " kvfn    " in ln]
    assert "/ mlx-lm sync " in line and " piped " in line


def test_profile_decode_counts_duo_steps_without_position_writes(capsys):
    """A Duo step (two parts a layer, or their slots layout) writes only keys and values (a
    ring derives its positions) and takes no dependency to settle what it writes."""
    from examples import profile_decode
    from examples.benchmark_decode import SHAPES

    argv = ["--shape", "tiny", "--lengths", "512", "--primitives", "--duo", "0.5"]
    (counts,) = profile_decode.main(argv).values()
    layers = SHAPES["tiny"]["num_hidden_layers"]
    assert counts["duo slots"]["ScatterAxis"] == 2 * layers
    assert 2 * layers < counts["duo"]["ScatterAxis"] <= 4 * layers
    assert counts["duo"]["Depends"] == counts["duo slots"]["Depends"] == 0
    assert "duo slots" in capsys.readouterr().out


def test_benchmark_duo_times_every_loop_in_rounds(capsys, monkeypatch):
    """benchmark_duo's rows: Duo holds fewer bytes than the full cache, every loop is timed in
    each round, and bad limits are refused by name."""
    from examples import benchmark_duo

    argv = ["--shape", "tiny", "--lengths", "300", "--ratios", "0.5", "0.25", "--sink", "4",
            "--recent", "16", "--chunk", "128", "--steps", "2"]  # fmt: skip
    runs, rounds_ms, real = [], [], benchmark_duo.in_rounds

    def counted(loops, rounds):
        def run(name, loop):
            runs.append(name)
            return loop()

        rounds_ms.append(real({k: functools.partial(run, k, v) for k, v in loops.items()}, rounds))
        return rounds_ms[-1]

    monkeypatch.setattr(benchmark_duo, "in_rounds", counted)
    half, quarter = benchmark_duo.main(argv + ["--rounds", "2"])
    # per ratio: the full caches' 5 loops, then union + 2 x (sync, piped, host), in turn, then
    # in reverse
    assert len(runs) == 2 * 2 * 12 and len(set(runs)) == 12
    assert runs[:12] == runs[12:24][::-1] == runs[24:36] == runs[36:][::-1]
    expected = {"duo_vs_mlx_lm_full": ("duo", "mlx_lm_full"),
                "duo_vs_union_mask": ("duo", "union_mask"),
                "slots_vs_mlx_lm_full": ("slots", "mlx_lm_full"),
                "slots_vs_kvfn_full": ("slots", "kvfn_full"),
                "slots_vs_mlx_lm_full_piped": ("slots_piped", "mlx_lm_full_piped"),
                "slots_vs_kvfn_full_piped": ("slots_piped", "kvfn_full_piped"),
                "duo_vs_mlx_lm_full_piped": ("duo_piped", "mlx_lm_full_piped")}  # fmt: skip
    assert set(benchmark_duo.RATIOS) == set(expected)
    for row, times in zip((half, quarter), rounds_ms):  # times: the ratio's two rounds
        assert row["duo"] == pytest.approx(sum(times["duo"]) / 2)
        for name, (a, b) in expected.items():  # each round's own ratio
            own = sorted(x / y for x, y in zip(times[a], times[b]))
            assert row[name + "_range"] == pytest.approx(own)
            assert row[name] == pytest.approx(sum(own) / 2)
    assert quarter["duo_mb"] < half["duo_mb"] < half["full_mb"]
    timed = ("mlx_lm_full", "kvfn_full_piped", "union_mask", "duo", "duo_piped", "slots_host")
    assert all(row[k] > 0 for row in (half, quarter) for k in timed)
    # every kvfn loop writes its state in place once the state is its own: synchronously on any
    # backend; pipelined on the CPU (on CUDA, whether a write encoded while the previous step
    # still runs may donate its buffer is what the column is there to find out)
    piped = mx.default_device() == mx.cpu
    for row in (half, quarter):
        mbs = {k: row[f"{k}_step_mb"][: 1 + piped] for k in ("kvfn_full", "duo", "slots")}
        assert max(mbs["kvfn_full"]) < 0.25 * row["full_mb"]
        assert max(mbs["duo"] + mbs["slots"]) < 0.25 * row["duo_mb"]
    out = capsys.readouterr().out
    assert "| 300 | 0.50 |" in out and "| 300 | 0.25 |" in out
    for bad, message in (
        (["--rounds", "0"], "--rounds >= 1"),
        (["--steps", "60"], "--steps <= 59"),
    ):
        with pytest.raises(SystemExit):
            benchmark_duo.main(argv[:-2] + bad)
        assert message in capsys.readouterr().err


def test_benchmark_duo_times_adakvs_ragged_rows_beside_plain_ones(capsys):
    """benchmark_duo --adakv: a ragged row's ratios recompute from its times, its KV is its
    budget's share of the full cache's, and a bad budget is refused by name."""
    from examples import benchmark_duo

    (row,) = benchmark_duo.main(["--shape", "tiny", "--lengths", "300", "--ratios", "--adakv",
                                 "64", "--chunk", "128", "--steps", "2"])  # fmt: skip
    assert row["budget"] == 64 and abs(row["kv_fraction"] - 64 / 299) < 0.01
    for name, (a, b) in benchmark_duo.RAGGED_RATIOS.items():
        assert row[name] == pytest.approx(row[a] / row[b])
    assert "| 300 | 64 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark_duo.main(["--shape", "tiny", "--lengths", "300", "--adakv", "400"])
    assert "--adakv: budgets must be in [36, 300)" in capsys.readouterr().err


def test_profile_host_times_a_chain_of_each_kind(capsys):
    """profile_host's chains hold the primitives they claim (so the slope is per primitive), a
    scatter chain writes the row, and kinds this backend lacks or does not know are named."""
    from examples import profile_decode, profile_host

    for kind, name in (("slice", "Slice"), ("gather", "GatherAxis"), ("scatter", "ScatterAxis"),
                       ("reshape", "Reshape"), ("depends", "Depends")):  # fmt: skip
        x, aux = profile_host._inputs(kind, 6)
        counts = profile_decode.primitives([profile_host.chain(kind, 6)(x, aux)])
        assert counts[name] == 6 * profile_host.PER_LINK.get(kind, 1), (kind, counts)
    x, aux = profile_host._inputs("scatter", 3)
    assert profile_host.chain("scatter", 3)(x, aux)[0].tolist() == [1.0] * profile_host.WIDTH
    out = profile_host.main(["--kinds", "slice", "scatter", "custom", "--lengths", "4", "8",
                             "--steps", "2"])  # fmt: skip
    assert set(out) == {"slice", "scatter"} | ({"custom"} if profile_host.on_cuda() else set())
    assert all(set(v) == set(profile_host.PHASES) for v in out.values())
    printed = capsys.readouterr().out
    assert "| scatter |" in printed and ("CUDA only" in printed) != profile_host.on_cuda()
    for bad, message in ((["--kinds", "nope"], "unknown \\['nope'\\]"),
                         (["--lengths", "8", "4"], "0 < SHORT < LONG")):  # fmt: skip
        with pytest.raises(SystemExit):
            profile_host.main(bad)
        assert re.search(message, capsys.readouterr().err)


def test_profile_decode_times_each_step_and_reads_ncu_csv(capsys, tmp_path):
    from examples import profile_decode

    profile_decode.main(["--shape", "tiny", "--lengths", "128", "--steps", "2", "--rounds", "1",
                         "--phases"])  # fmt: skip
    out = capsys.readouterr().out
    for name in ("mlx-lm", "kvfn", "kvfn masked SDPA"):
        (timed,) = [ln for ln in out.splitlines() if f" {name:18s} " in ln and "spread" in ln]
        assert all(float(x) > 0 for x in timed.split("(")[0].split()[-3:]), timed
        assert any(f" {name:18s} build" in ln and "encode" in ln for ln in out.splitlines())
    head = '"ID","Kernel Name","Grid Size","Block Size","Metric Value"\n'
    rows = [("phase_mlx", "1"), ("gemv", "2,000"), ("gemv", "1,000"), ("phase_kvfn", "1"),
            ("split", "3,000"), ("phase_end", "1")]  # fmt: skip
    csv = head + "".join(f'"{i}","{n}(x)","(1, 1, 1)","(32, 1, 1)","{v}"\n'
                         for i, (n, v) in enumerate(rows))  # fmt: skip
    (tmp_path / "ncu.csv").write_text("==PROF== noise\n" + csv)
    profile_decode.main(["--read-ncu", str(tmp_path / "ncu.csv")])
    out = capsys.readouterr().out
    assert "mlx: 2 kernels, 3 us" in out and "kvfn: 1 kernels, 3 us" in out
    assert "   2      3.0 us  gemv(x)" in out
    ms = profile_decode.main(["--shape", "tiny", "--prefill-chunk", "48"])
    assert set(ms) == {"mlx-lm", "kvfn", "kvfn scored"} and min(ms.values()) > 0
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        profile_decode.main(["--read-ncu", str(tmp_path / "other.csv")])


def test_profile_prefill_shows_kvfn_states_made_at_full_size():
    from examples import profile_prefill

    result = profile_prefill.main(["--shape", "tiny", "--length", "256", "--chunk", "128",
                                   "--window", "8", "--rounds", "1"])  # fmt: skip
    assert set(result) == set(profile_prefill.ROWS)
    chunks = {name: runs[0] for name, runs in result.items()}
    assert all(len(c) == 2 for c in chunks.values())
    full, grown = [c[2] for c in chunks["kvfn"]], [c[2] for c in chunks["grown"]]
    assert full[0] == pytest.approx(full[1], rel=1e-3)  # the whole capacity from chunk 0
    # grown to the same K/V (and a positions buffer, where init's is a broadcast arange)
    assert grown[0] < grown[1] == pytest.approx(full[1], rel=0.02)
    assert grown[0] < full[0]  # half the rows after the first of two chunks


def test_profile_prefill_rejects_a_window_past_the_prompt(capsys):
    from examples import profile_prefill

    with pytest.raises(SystemExit):
        profile_prefill.main(["--length", "64", "--window", "65"])
    assert "--window: must be <= --length (64), got 65" in capsys.readouterr().err


def test_benchmark_scoring_compares_both_ops_and_refuses_bad_limits(capsys):
    from examples import benchmark_scoring

    rows = benchmark_scoring.main(["--iters", "1", "--calls", "2", "--capacities", "96"])
    assert [(r["op"], r["queries"]) for r in rows] == [("sum", 32), ("max", 64)]
    cuda = kvfn.kernels.on_cuda()
    for r in rows:  # off CUDA both columns run the stock ops: the same arrays
        assert r["kernels_ms"] > 0 and r["stock_ms"] > 0 and r["kernels_mb"] > 0
        assert r["max_abs_diff"] < 1e-5 if cuda else r["max_abs_diff"] == 0.0
    assert "| max (64) | 96 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark_scoring.main(["--capacities", "32"])
    assert "got 20, 32, [32]" in capsys.readouterr().err


def test_profile_timeline_reads_busy_idle_and_kernel_classes():
    from examples import profile_timeline as pt

    kernels = [  # (name, start us, duration us): two steps
        ("void mlx::core::cu::gemv_single<bf16, 4>", 0.0, 10.0),
        ("mlx::core::cu::custom_kernel_kvfn_ragged_decode_split_802aff<bf16>", 5.0, 10.0),
        ("void mlx::core::cu::scatter_axis<>", 40.0, 5.0),
        ("void mlx::core::cu::gemv_single<bf16, 4>", 100.0, 10.0),
    ]
    s = pt.summary(kernels, steps=2, wall_s=0.004)
    assert s["wall_ms"] == pytest.approx(2.0)
    assert s["kernels"] == 2 and s["kernel_ms"] == pytest.approx(0.0175)
    assert s["busy_ms"] == pytest.approx(0.015)  # 0-15, 40-45, 100-110: overlap counted once
    assert s["span_ms"] == pytest.approx(0.055) and s["idle_ms"] == pytest.approx(0.04)
    assert s["gaps_over_20us"] == 1.0  # 15 -> 40 and 45 -> 100, in two steps
    assert s["idle_in_gaps_over_20us_ms"] == pytest.approx(0.04)
    assert s["classes_ms"] == pytest.approx({"attention": 0.005, "kv write": 0.0025,
                                             "matmul": 0.01})  # fmt: skip
    calls, per_call, per_step = s["names"]["void mlx::core::cu::gemv_single"]
    assert (calls, per_call, per_step) == (1.0, 10.0, 10.0)
    assert pt.kernel_class("cudnn_generated_fort_native_sdpa_sm80_flash") == "attention"
    assert pt.kernel_class("void mlx::core::cu::rms_norm_small<>") == "norm"
    assert pt.kernel_class("void mlx::core::cu::arange<>") == "other"


def test_profile_timeline_needs_cuda(capsys):
    from examples import profile_timeline as pt

    with pytest.raises(SystemExit):
        pt.main(["--splits", "0"])
    assert "argument --splits: values must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pt.main(["--top", "-1"])
    assert "argument --top: values must be >= 0" in capsys.readouterr().err
    if kvfn.kernels.on_cuda():
        pytest.skip("on MLX's CUDA backend it would run")
    with pytest.raises(SystemExit, match="CUDA"):
        pt.main(["--shape", "tiny"])


def test_profile_timeline_counts_api_calls_and_builds_duo_states(capsys):
    from examples import profile_decode
    from examples import profile_timeline as pt
    from examples.profile_decode import filled

    api = [("cudaGraphLaunch", 0.0, 100.0), ("cudaGraphLaunch", 50.0, 60.0),
           ("cudaGraphExecUpdate", 10.0, 40.0)]  # fmt: skip
    s = pt.summary([("void mlx::core::cu::gather<>", 0.0, 3.0)], steps=2, wall_s=0.001, api=api)
    assert s["api_ms"] == pytest.approx(0.055)  # a call inside another counts once: 0-110 us
    assert list(s["api"]) == ["cudaGraphLaunch", "cudaGraphExecUpdate"]
    assert s["api"]["cudaGraphLaunch"] == (1.0, 80.0, 80.0)
    assert pt.kernel_class("custom_kernel_kvfn_two_part_decode_split_265") == "attention"
    model = benchmark_decode.random_model("tiny", False, mx.float32)
    _, states = filled(model, 400, 8, mx.float32)
    duo = pt.duo_states(states, 0.25, 8)
    groups = [g for s in duo for g in getattr(s, "parts", (s,))]
    retrieval = sum(g.keys.shape[1] for g in groups if isinstance(g, kvfn.cache.State))
    assert retrieval == round(0.25 * len(states) * states[0].keys.shape[1])
    for bad, message in ((["--duo", "1.5"], "retrieval ratio in \\(0, 1\\), got 1.5"),
                         (["--duo", "0.25", "--rows", "300"], "must exceed 320")):  # fmt: skip
        for main, rows in ((pt.main, "--rows"), (profile_decode.main, "--lengths")):
            with pytest.raises(SystemExit):
                main([rows if a == "--rows" else a for a in bad])
            assert re.search(message, capsys.readouterr().err)
    assert pt.row_names([8], True)[3:] == ["kvfn 8 splits", "kvfn full", "duo", "duo 8 splits",
                                           "duo slots", "duo slots 8 splits"]  # fmt: skip
    with pytest.raises(SystemExit):
        pt.main(["--loops", "mlx-lm", "duo"])  # no --duo: there is no duo row
    assert "no rows named ['duo']" in capsys.readouterr().err


def test_pipelined_loop_writes_the_state_in_place():
    """Only the step's first array is queued, so the next step's K/V writes reuse the buffers;
    holding (and queuing) the state makes every write copy its buffer (``step_mb`` sees it).
    Steps evaluated one at a time write in place too."""
    from examples.profile_decode import filled, kvfn_loop, packed

    model = benchmark_decode.random_model("tiny", False, mx.float32)
    caches, states = filled(model, 4096, 64, mx.float32)
    state = packed(states, 4096, 64)
    del caches, states
    layer_kv = state[0].keys.nbytes
    fm = kvfn.FunctionalModel(model)
    grown = {held: 1e6 * benchmark_decode.step_mb(kvfn_loop(fm, state), 6, piped=True, held=held)
             for held in (False, True)}  # fmt: skip
    assert grown[False] < layer_kv / 4, grown
    assert grown[True] > len(state) * layer_kv, grown
    assert 1e6 * benchmark_decode.step_mb(kvfn_loop(fm, state)) < layer_kv / 4


def test_profile_timeline_rows_decode_a_batch_as_mlx_lm_does():
    """--batch B: each sequence holds its own rows, and every row's loop (mlx-lm's, kvfn's over
    the packed rows, its masked SDPA, a fixed split count) decodes the same B tokens a step."""
    from examples import profile_timeline
    from examples.profile_decode import filled

    model = benchmark_decode.random_model("tiny", False, mx.float32)
    caches, states = filled(model, 96, 8, mx.float32, batch=3)
    assert caches[0].keys.shape[0] == 3 and not mx.array_equal(caches[0].keys[0], caches[0].keys[1])
    args = argparse.Namespace(batch=3, splits=[2], duo=None)
    builders = profile_timeline.row_builders(model, caches, states, 96, 8, args)
    tokens = {}
    for name in ("mlx-lm", "kvfn", "kvfn masked SDPA", "kvfn 2 splits"):
        build = builders[name]()  # each loop appends to its own rows: mlx-lm's cache, a state
        taken = hasattr(build, "settings")  # a variant's builder ran its first step to trace it
        tokens[name] = mx.concatenate([build()[0] for _ in range(3 if taken else 4)], axis=1)
        tokens[name] = tokens[name][:, -3:]
    assert tokens["mlx-lm"].shape == (3, 3)
    for name, toks in tokens.items():
        assert mx.array_equal(toks, tokens["mlx-lm"]), (name, toks, tokens["mlx-lm"])


def test_profile_timeline_names_a_bad_batch(capsys):
    from examples import profile_timeline

    for argv, said in ((["--batch", "0"], "--batch: values must be >= 1, got [0]"),
                       (["--batch", "2", "--duo", "0.25", "--rows", "4096"],
                        "--duo rows run one sequence, got --batch 2")):  # fmt: skip
        with pytest.raises(SystemExit):
            profile_timeline.main(argv)
        assert said in capsys.readouterr().err
    # rows that cannot fit are named before any is filled: the weights and three copies of them
    model = benchmark_decode.random_model("tiny", False, mx.float32)
    parser = argparse.ArgumentParser()
    need = benchmark_decode.weights_bytes(model) + 3 * profile_timeline.kv_bytes(
        model, 4096 + 10, 2, mx.float32
    )
    profile_timeline.check_memory(parser, model, [1024, 4096], 10, 2, mx.float32, need)
    with pytest.raises(SystemExit):
        profile_timeline.check_memory(parser, model, [1024, 4096], 10, 2, mx.float32, need - 1)
    assert "--rows: 4096 rows of --batch 2 need about" in capsys.readouterr().err


def test_benchmark_kernels_chain_reads_each_kernels_mean_and_needs_cuda(monkeypatch, capsys):
    from examples import benchmark_kernels as bk

    kernels = [("void split<bf16, 4>", 0.0, 10.0), ("void combine<bf16>", 10.0, 2.0),
               ("void split<bf16, 4>", 20.0, 14.0), ("void combine<bf16>", 34.0, 3.0),
               ("void split<bf16, 4>", 40.0, 12.0)]  # fmt: skip
    assert bk.per_call(kernels) == "12.0 + 2.5"  # the costliest name first, each its mean

    from examples import profile_timeline

    def recorded(run, steps):  # profile_timeline.recorded's contract, without CUPTI
        run(steps)
        return [("void split<bf16, 4>", 0.0, 7.0)], [("cudaGraphLaunch", 0.0, 1.0)], 0.01

    monkeypatch.setattr(profile_timeline, "recorded", recorded)
    bk.chain_table(bk.load_kernels(), [512], layers=2, steps=1)  # every column runs
    out = capsys.readouterr().out
    assert "| 512 | 7.0 | 7.0 (" in out and out.rstrip().endswith("| 7.0 | 7.0 |")

    # --decoded T: the split kernel plans over capacity + 2T slots, cuDNN reads capacity + T rows
    kk = bk.load_kernels()  # a fresh module: nothing to restore
    kk.TENSOR_CORES, kk.MMA_RUN_DIMS = True, (128,)
    sdpa, seen = mx.fast.scaled_dot_product_attention, set()

    def recording_sdpa(q, k, v, **kw):
        if kw.get("mask") is None:  # cuDNN's column (the kernel's CPU fallback passes a mask)
            seen.add(k.shape[2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording_sdpa)
    bk.chain_table(kk, [512], layers=2, steps=1, decoded=300)
    out = capsys.readouterr().out
    assert "300 rows decoded: capacity + 300 valid of capacity + 600" in out
    assert "| 512 | 7.0 | 7.0 (2 splits, tensor cores) |" in out  # 1112 slots, 512-row splits
    assert seen == {812}
    assert bk.decoded_rows("0") == 0 and bk.decoded_rows("20") == 20
    for bad in ("-1", "x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            bk.decoded_rows(bad)

    if kvfn.kernels.on_cuda():
        pytest.skip("on MLX's CUDA backend it would run")
    monkeypatch.setattr("sys.argv", ["benchmark_kernels.py", "--chain", "--capacities", "64"])
    with pytest.raises(SystemExit, match="CUDA"):
        bk.main()


def test_kernel_settings_parse_and_name_the_bad_one():
    """``--configs`` of benchmark_kernels / profile_decode: G,U,B[,S[,T[,W]]], T 0 (CUDA cores)
    or 1 (tensor cores on every split they take), W warps a block (4 unless given)."""

    from examples.benchmark_kernels import kernel_config, kernel_settings

    assert kernel_config("4,4,3") == (4, 4, 3, 0, 0, 4)
    assert kernel_config("4,4,3,2") == (4, 4, 3, 2, 0, 4)
    assert kernel_config("4,4,3,2,1") == (4, 4, 3, 2, 1, 4)
    assert kernel_config("4,4,1,2,0,8") == (4, 4, 1, 2, 0, 8)
    assert kernel_settings(kernel_config("4,4,3,2"))["TENSOR_CORES"] is False
    assert kernel_settings(kernel_config("4,4,3,2"))["THREADS"] == 128
    eight = kernel_settings(kernel_config("4,4,1,2,0,8"))
    assert eight["THREADS"] == eight["MMA_THREADS"] == 256  # either kernel's blocks
    assert eight["BLOCKS_PER_SM"] == eight["MMA_BLOCKS_PER_SM"] == 1
    on = kernel_settings(kernel_config("4,4,3,2,1"))
    assert on["TENSOR_CORES"] is True and on["MMA_MIN_KEYS_PER_SPLIT"] == 0
    assert on["MMA_RUN_DIMS"] is None  # every head_dim the kernel takes
    bad_ones = ("4,4", "4,4,3,2,2", "0,4,3", "4,4,3,2,1,3", "4,4,3,2,1,16", "4,4,3,2,1,4,1")
    for bad in bad_ones + ("4,x,3",):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            kernel_config(bad)


def test_split_rows_set_both_kernels_splits(monkeypatch):
    """``--split-rows N``: plan gives either kernel (CUDA cores, or tensor cores on every split
    they take) splits of at least N rows; a bad N is named."""

    from examples.benchmark_kernels import (
        kernel_config,
        kernel_settings,
        patched,
        split_rows,
        split_settings,
    )

    kk = kvfn.kernels
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    k = mx.zeros((1, 8, 4096, 128), mx.bfloat16)
    for tc, rows, splits in ((0, 256, 16), (0, 1024, 4), (1, 512, 8), (1, 1024, 4)):
        settings = {**kernel_settings(kernel_config(f"4,4,3,2,{tc}")), **split_settings(rows)}
        with patched(kk, **settings):
            mma = kk._mma_applies(q, k)
            assert mma == bool(tc) and kk.plan(1, 32, 8, 4096, mma)[2] == splits
    with patched(kk, TENSOR_CORES=True, **split_settings(1024)):  # the module's plan otherwise
        assert kk._mma_applies(q, k) and kk.plan(1, 32, 8, 4096, True)[2] == 4  # default 8
    assert split_settings(None) == {} and split_rows("512") == 512
    for bad in ("0", "-4", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            split_rows(bad)


def test_launches_run_each_split_size_and_restore_the_plan(capsys):
    """``--launches`` (for ncu): each capacity's attention in each split size, its plan printed,
    the module's settings back afterwards."""
    from examples.benchmark_kernels import launches, patched

    kk = kvfn.kernels
    before = kk.MIN_KEYS_PER_SPLIT, kk.MMA_MIN_KEYS_PER_SPLIT, kk.MMA_KEYS_PER_SPLIT
    with patched(kk, TENSOR_CORES=True):
        launches(kk, [512, 2048], [64, None], repeat=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["capacity 512, split rows 64: 8 splits, tensor cores",
                     "capacity 512, split rows default: 1 split, tensor cores",  # of 512 rows
                     "capacity 2048, split rows 64: 12 splits, tensor cores",  # MMA_FILL
                     "capacity 2048, split rows default: 4 splits, tensor cores"]  # fmt: skip
    assert (kk.MIN_KEYS_PER_SPLIT, kk.MMA_MIN_KEYS_PER_SPLIT, kk.MMA_KEYS_PER_SPLIT) == before


def test_patched_settings_are_restored_even_when_the_block_fails():
    """benchmark_kernels.patched: kernel settings inside the block, the old ones after it."""
    import kvfn.kernels as kernels
    from examples.benchmark_kernels import patched

    before = kernels.STAGES, kernels.TENSOR_CORES
    with pytest.raises(RuntimeError, match="inside"):
        with patched(kernels, STAGES=before[0] + 3, TENSOR_CORES=not before[1]):
            assert (kernels.STAGES, kernels.TENSOR_CORES) == (before[0] + 3, not before[1])
            raise RuntimeError("inside")
    assert (kernels.STAGES, kernels.TENSOR_CORES) == before


def test_benchmark_policies_prints_kvzip_beside_mlx_lm(capsys, tmp_path):
    from examples import benchmark_policies

    result = benchmark_policies.main(["--shape", "tiny", "--lengths", "96", "--chunk", "32",
                                      "--pass-chunk", "40", "--json", str(tmp_path / "p.json")])  # fmt: skip
    (row,) = result["kvzip"]
    assert row["L"] == 96 and row["chunk"] == 32 and row["pass_chunk"] == 40
    rounds = row["rounds_s"]
    assert all(len(s) == 3 for s in rounds.values())  # --rounds' default
    pairs = {"time_ratio": ("kvzip", "mlx"), "prefill_ratio": ("prefill", "mlx")}
    for name, (a, b) in pairs.items():
        ratios = sorted(x / y for x, y in zip(rounds[a], rounds[b]))  # each round's own
        assert row[name] == pytest.approx(ratios[1])
        assert row[name + "_range"] == pytest.approx([ratios[0], ratios[-1]])
    assert row["kvzip_s"] == pytest.approx(sorted(rounds["kvzip"])[1])
    assert row["mem_ratio"] == pytest.approx(row["kvzip_gb"] / row["mlx_gb"])
    assert row["kvzip_gb"] == pytest.approx(sorted(row["rounds_gb"]["kvzip"])[1])
    assert row["kvzip_s"] > row["prefill_s"] > 0  # the pass runs after the same prefill
    out = capsys.readouterr().out.splitlines()
    (line,) = [ln for ln in out if ln.startswith("| 96 | 32 / 40 |")]
    assert f"| {row['time_ratio']:.2f}" in line and f"| {row['mem_ratio']:.2f} |" in line
    assert (tmp_path / "p.json").stat().st_size > 100


def test_benchmark_policies_rejects_bad_values(capsys):
    from examples import benchmark_policies

    with pytest.raises(SystemExit):
        benchmark_policies.main(["--pass-chunk", "0"])
    assert "--pass-chunk: values must be >= 1, got [0]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark_policies.main(["--tables", "duo"])
    assert "invalid choice: 'duo'" in capsys.readouterr().err


def test_benchmark_policies_prints_the_decode_rows_in_the_same_process(capsys):
    from examples import benchmark_duo, benchmark_policies

    result = benchmark_policies.main(["--shape", "tiny", "--lengths", "400", "--chunk", "128",
                                      "--rounds", "1", "--tables", "kvzip", "decode"])  # fmt: skip
    duo, ragged = result["decode"]
    assert duo["ratio"] == 0.25 and ragged["budget"] == 50 and result["kvzip"][0]["L"] == 400
    for row, pairs in ((duo, benchmark_duo.RATIOS), (ragged, benchmark_duo.RAGGED_RATIOS)):
        for name, (a, b) in pairs.items():
            assert row[name] == pytest.approx(row[a] / row[b])
    out = capsys.readouterr().out
    assert "| 400 | 0.25 |" in out and "| 400 | 50 |" in out


def test_profile_new_length_times_each_phase_new_then_repeated(capsys):
    from examples import profile_new_length

    rows = profile_new_length.main(["--lengths", "120", "131", "--budget", "16", "--window", "8"])
    phases = [r["phase"] for r in rows]
    assert phases[:2] == ["prefill", "scored_prefill"] and phases[-1] == "snapkv compact_states"
    assert all(r["new_ms"] > 0 and r["repeat_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "lengths [131] (each new; 120 warmed up)" in out and out.count('"length": 131') == len(
        rows
    )


@pytest.mark.parametrize("argv", [["--lengths", "120", "120"], ["--lengths", "20", "131"]])
def test_profile_new_length_refuses_lengths_it_cannot_compare(argv, capsys):
    from examples import profile_new_length

    with pytest.raises(SystemExit):
        profile_new_length.main(argv)
    assert "need two or more distinct lengths, each past budget + window" in capsys.readouterr().err


def test_the_warm_up_benchmark_gives_mlx_lms_server_the_flags_less_kvfns(capsys):
    """``benchmark_warmup``'s ``none`` server takes --flags less every ``--kv-*`` flag and its
    value (the same prefill step, model and limits); the others add the warm-up flag; a bad kind,
    length or a warm-up flag of the caller's is refused by name."""
    from examples import benchmark_warmup as bw

    flags = ("--kv-eviction snapkv --kv-budget 256 --prefill-step-size 512 --kv-max-rows 1024 "
             "--max-tokens 9")
    args = bw.parse_args(["--flags", flags, "--model", "m.gguf", "--lengths", "300,700"])
    assert bw.server_flags("none", args) == ["--prefill-step-size", "512", "--max-tokens", "9",
                                             "--model", "m.gguf", "--kv-eviction", "none"]  # fmt: skip
    assert bw.server_flags("warmup", args)[-1] == "--kv-warmup"
    assert bw.server_flags("no-warmup", args)[:-1] == [*flags.split(), "--model", "m.gguf"]
    assert args.lengths == [300, 700]
    bad_args = [(["--kinds", "warmup,cold"], "'cold'"), (["--lengths", "300,x"], "300,x"),
                (["--lengths", "8"], "8 tokens"),
                (["--flags", "--kv-budget 9 --no-kv-warmup"], "warm-up")]
    for bad, named in bad_args:
        with pytest.raises(SystemExit):
            bw.parse_args(bad)
        assert named in capsys.readouterr().err
