"""Training-free head profiling: the scorers on planted attention, a planted echo head found
end to end, the pattern files and the ``kvfn heads`` command."""

import importlib

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn import heads
from kvfn.cli import main as cli


def planted_rows(T=40, w=5, n_heads=4, layers=2, target=None):
    """Uniform attention rows, except head (1, 2) whose queries put 0.9 on ``target[j]``."""
    rows = [np.full((n_heads, w, T), 1.0 / T) for _ in range(layers)]
    for j, t in enumerate(target):
        rows[1][2, j] = 0.1 / (T - 1)
        rows[1][2, j, t] = 0.9
    return rows


def test_copy_scores_find_the_head_that_copies_the_needle():
    tokens = list(range(40))
    needle = [10, 11, 12, 13, 14]
    copy_start = 35  # queries 34..38 predict the copies of tokens 10..14
    tokens[35:40] = tokens[10:15]
    rows = planted_rows(target=needle)
    hit, mass = heads.copy_scores(rows, tokens, needle, copy_start, start=34)
    assert hit[1, 2] == 1.0 and hit.sum() == 1.0
    assert mass[1, 2] == pytest.approx(0.9 + 4 * 0.1 / 39)
    assert np.argmax(mass) == np.ravel_multi_index((1, 2), mass.shape)
    kv_scores = heads.to_kv_heads(hit, [2, 2])  # 4 query heads over 2 KV heads
    assert kv_scores.tolist() == [[0.0, 0.0], [0.0, 1.0]]


def test_razor_scores_reward_echo_and_induction():
    L = 20  # a 20-token sequence seen twice; queries 35..39 lie in the second copy
    rows = planted_rows(T=40, target=[35 - L + 1, 36 - L + 1, 37 - L + 1, 38 - L + 1, 39 - L + 1])
    s = heads.razor_scores(rows, L, start=35)
    assert np.argmax(s) == np.ravel_multi_index((1, 2), s.shape)
    assert s[1, 2] > 0.9 and s[0, 0] == pytest.approx(2 / 40)


def echo_model(head: int):
    """A 2-layer tiny llama whose layer-0 KV head ``head`` attends to earlier copies of the
    query's own token (an echo head; it splits its attention between itself and the earlier
    copy): its q and k read the same embedding dims, scaled up, where RoPE barely rotates."""
    module = importlib.import_module("mlx_lm.models.llama")
    args = module.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5,
        vocab_size=97, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        rope_theta=1e12, rope_traditional=True))  # fmt: skip
    mx.random.seed(0)
    model = module.Model(args)
    attn = model.model.layers[0].self_attn
    q = np.array(attn.q_proj.weight) * 0.01
    k = np.array(attn.k_proj.weight) * 0.01
    # head dims 4..15: RoPE pairs whose angle stays ~0 at this theta (pairs 0 and 1 turn)
    rows = slice(16 * head + 4, 16 * head + 16)
    q[16 * head : 16 * head + 16] = 0.0
    k[16 * head : 16 * head + 16] = 0.0
    q[rows, rows] = 6.0 * np.eye(12)
    k[rows, rows] = 6.0 * np.eye(12)
    attn.q_proj.weight = mx.array(q)
    attn.k_proj.weight = mx.array(k)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("head", [1, 3])
def test_profiling_finds_a_planted_echo_head(head):
    pattern = heads.profile_heads(echo_model(head), method="razor", length=96, samples=2)
    scores = np.array(pattern.scores)
    assert scores.shape == (2, 4)
    assert np.argmax(scores[0]) == head
    assert scores[0, head] > 0.3 > 0.1 > np.delete(scores[0], head).max()
    assert pattern.retrieval(ratio=1 / 8)[0][head]


def test_smollm2_retrieval_profile(smollm2, tmp_path):
    model, tokenizer = smollm2
    pattern = heads.profile_heads(model, tokenizer, method="retrieval", length=256, samples=1)
    scores = np.array(pattern.scores)
    assert scores.shape == (30, 3) and scores.min() >= 0.0 and scores.max() <= 1.0
    assert scores.max() > 0.5  # some head copies the needle from the context
    assert (scores == 0).mean() > 0.3  # and most do not: the score separates heads


def test_profile_rejects_bad_values(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="unknown head profiling method"):
        heads.profile_heads(model, method="gates")
    with pytest.raises(ValueError, match="tokenizer"):
        heads.profile_heads(model, method="retrieval")
    with pytest.raises(ValueError, match="length"):
        heads.profile_heads(model, method="razor", length=8)


def test_cli_writes_a_pattern_folder_duo_loads(tmp_path, capsys):
    out = tmp_path / "pattern"
    cli(["heads", "--method", "razor", "--length", "96", "--samples", "1", "--out", str(out)])
    assert "30 layers x 3 KV heads" in capsys.readouterr().out
    pattern = kvfn.HeadPattern.load(out)
    assert pattern.shape == (30, 3) and (pattern.sink_size, pattern.recent_size) == (64, 256)
    policy = kvfn.parse_policy("duo-r25", pattern=pattern)
    assert sum(map(sum, policy.heads)) == round(0.25 * 90)
    with pytest.raises(SystemExit):
        cli(["nothing"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sink-size", "-1"], "--sink-size: must be >= 0, got -1"),
        (["--seed", "-1"], "--seed: must be an integer in [0, 2**64), got -1"),
        (["--length", "8"], "--length: must be >= 64, got 8"),
    ],
)
def test_cli_refuses_bad_flags_before_loading(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kvfn_models.load", lambda *a: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit):
        cli(["heads", *flags, "--out", str(tmp_path / "p")])
    assert message in capsys.readouterr().err


def test_cli_refuses_an_out_file_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kvfn_models.load", lambda *a: pytest.fail("loaded the model"))
    (tmp_path / "f").write_text("")
    for out in ("f", "f/sub"):
        with pytest.raises(SystemExit):
            cli(["heads", "--out", str(tmp_path / out)])
        assert f"--out: {tmp_path / 'f'} exists and is not a folder" in capsys.readouterr().err


def test_cli_reports_a_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="error: --model: no such model file or folder"):
        cli(["heads", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "p")])


def test_cli_bounds_length_by_the_context(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kvfn_models.load", lambda *a: smollm2)
    monkeypatch.setattr(heads, "profile_heads", lambda *a, **k: pytest.fail("profiled"))
    with pytest.raises(SystemExit):
        cli(["heads", "--length", "200000", "--out", str(tmp_path / "p")])
    assert "--length: 200000 exceeds the model's context of 8192 tokens" in capsys.readouterr().err
