"""Eviction on tensor-parallel models: 2 ranks under ``mlx.launch --backend ring`` (local CPU
processes) against the single-process run of the same models, policies and prompts.

- Tiny random llama, qwen2 and qwen3 (4 query / 2 KV heads): ``kvfn.distributed.shard`` is
  mlx-lm's ``Model.shard``, so each rank holds 2 query heads and 1 KV head.
- The embedded SmolLM2 (9 query / 3 KV heads): the heads do not split over 2 ranks, so only
  its MLPs are sharded and every rank holds all 3 KV heads (mlx-lm's own shard would cut
  heads apart: see ``test_uneven_heads_are_refused``).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from tests import distributed_ranks as ranks_script
from tests import test_server

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
RANKS = 2
TIMEOUT = 300


def launch(out: Path) -> subprocess.CompletedProcess:
    # the venv's python by its own path: resolving its symlink gives a python without mlx
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(RANKS), sys.executable,
           str(ROOT / "tests/distributed_ranks.py"), str(out)]  # fmt: skip
    # two ranks share this machine's cores: one BLAS thread each, or they oversubscribe
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # a rank left waiting in a collective hangs
        output, _ = proc.communicate()
        pytest.fail(f"mlx.launch ran past {TIMEOUT} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    if not LAUNCH.exists():
        pytest.skip(f"no mlx.launch beside {sys.executable}")
    out = tmp_path_factory.mktemp("ranks")
    run = launch(out)
    started = [json.loads(p.read_text()) for p in out.glob("started-rank*.json")]
    if not started:
        pytest.skip(f"mlx.launch could not start the ranks:\n{run.stdout[-2000:]}")
    if any(s["size"] != RANKS for s in started):
        pytest.skip(f"the ring backend gave groups of sizes {[s['size'] for s in started]}")
    assert run.returncode == 0, run.stdout[-3000:]
    return out


def rank_results(out: Path, case: str) -> list:
    return [dict(np.load(out / f"{case}-rank{r}.npz")) for r in range(RANKS)]


@pytest.fixture(scope="module", params=ranks_script.TINY)
def tiny(request) -> tuple:
    """(family, its single-process reference)."""
    model, prompt, policies, forced = ranks_script.tiny_case(request.param)
    return request.param, ranks_script.run(kvfn.FunctionalModel(model), prompt, policies, forced)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2) -> dict:
    model, prompt, policies, forced = ranks_script.smollm2_case(*smollm2)
    return ranks_script.run(kvfn.FunctionalModel(model), prompt, policies, forced)


def check_rank(mine: dict, single: dict, name: str, rank: int, sharded: bool) -> None:
    kept = single[f"{name}/positions"]
    if sharded:
        h = kept.shape[2] // RANKS
        kept = kept[:, :, rank * h : (rank + 1) * h]
    np.testing.assert_array_equal(mine[f"{name}/positions"], kept, err_msg=f"{name} rank {rank}")
    assert list(mine[f"{name}/tokens"]) == list(single[f"{name}/tokens"]), (name, rank)
    np.testing.assert_allclose(mine[f"{name}/logits"], single[f"{name}/logits"], atol=1e-3)
    share = RANKS if sharded else 1
    for key in ("bytes_before", "bytes_after"):
        assert int(mine[f"{name}/{key}"]) * share == single[f"{name}/{key}"], (name, key)


def test_tiny_two_ranks_keep_the_single_process_rows(launched, tiny):
    family, single = tiny
    for rank, mine in enumerate(rank_results(launched, f"tiny-{family}")):
        assert mine["heads_sharded"] and mine["group_found"]
        for name in ranks_script.tiny_policies():
            check_rank(mine, single, name, rank, sharded=True)


def test_layer_shared_policies_need_every_rank_s_scores(launched, tiny):
    """A rank selecting from its own heads' scores alone keeps other rows than one process:
    the all-gather is what makes the test above pass."""
    for rank, mine in enumerate(rank_results(launched, f"tiny-{tiny[0]}")):
        for name in ranks_script.SHARED:
            assert not np.array_equal(mine[f"{name}/alone"], mine[f"{name}/positions"]), name


def test_smollm2_two_ranks_equal_the_single_process_run(launched, smollm2_reference):
    results = rank_results(launched, "smollm2")
    for rank, mine in enumerate(results):
        assert not mine["heads_sharded"] and not mine["group_found"]
        for name in ranks_script.smollm2_policies():
            check_rank(mine, smollm2_reference, name, rank, sharded=False)


def test_uneven_heads_are_refused(launched):
    for rank in range(RANKS):
        message = (launched / f"uneven-rank{rank}.txt").read_text()
        assert "3 KV heads do not split evenly over 2 ranks" in message, message


def test_unsharded_model_has_no_group_and_selects_as_the_policy():
    from tests.tiny import tiny_model

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    assert fm.group is None
    policy = kvfn.SnapKV(budget=16, window=4, per_head=False)
    scores = mx.random.uniform(shape=(1, 4, 40))
    args = dict(prompt_length=40, n_kv_heads=2, batch=1, layer=0)
    got = kvfn.distributed.keep_indices(policy, scores, **args)
    assert np.array_equal(np.array(got), np.array(policy.keep_indices(scores, **args)))


def test_head_local_policies():
    assert kvfn.SnapKV(budget=64).head_local
    assert not kvfn.SnapKV(budget=64, per_head=False).head_local
    assert not kvfn.ChunkKV(budget=64).head_local
    assert not kvfn.Policy.head_local


def launch_server(flags: list) -> tuple:
    """kvfn-server under mlx.launch (2 ranks) and the port rank 0 prints; killed after TIMEOUT."""
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(RANKS), sys.executable, "-m",
           "kvfn.serving.server", *test_server.COMMON, *flags]  # fmt: skip
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    proc.deadline = threading.Timer(TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
    proc.deadline.start()
    seen = []
    for line in proc.stdout:
        seen.append(line)
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
    proc.deadline.cancel()
    pytest.skip(f"kvfn-server did not start under mlx.launch:\n{''.join(seen)[-2000:]}")


def test_server_under_mlx_launch_answers_as_one_process(launched):
    """Rank 0 serves HTTP, rank 1 follows; a compacted request gets the single-process answer."""
    question = ranks_script.smollm2_prompt_text()
    single, port = test_server.start(test_server.EVICT)
    try:
        want = test_server.Server(port).chat(question, max_tokens=12)
    finally:
        single.terminate()
        single.wait(30)
    proc, port = launch_server(test_server.EVICT)
    try:
        got = test_server.Server(port).chat(question, max_tokens=12)
    finally:
        proc.deadline.cancel()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.kv_eviction == want.usage.kv_eviction
    assert want.usage.kv_eviction["rows_kept"] < want.usage.kv_eviction["rows_total"]
