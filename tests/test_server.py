"""kvfn-server against the official openai client, on loopback, with the embedded SmolLM2.

Prompts are scaled to this CPU (a 2K-token prefill of SmolLM2 takes 25-50 s here): "long"
prompts are ~250-300 tokens with a 64-row budget, so they are compacted the same way.
"""

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Optional

import openai
import pytest

ROOT = Path(__file__).resolve().parents[1]
EVICT = ["--kv-eviction", "snapkv", "--kv-budget", "64", "--kv-window", "8"]
COMMON = ["--port", "0", "--prefill-step-size", "512", "--max-tokens", "16", "--log-level", "ERROR"]
MODEL = "default_model"


def start(flags: list[str]):
    """A kvfn-server process and its port (read from the line it prints)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfn.serving.server", *COMMON, *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    lines = []
    for line in proc.stdout:  # a warm-up, then the port
        lines.append(line)
        match = re.search(r"listening on http://[^:]+:(\d+)", line)
        if match:
            proc.started = lines
            return proc, int(match.group(1))
    proc.kill()
    raise RuntimeError(f"kvfn-server did not start: {lines!r}")


class Server:
    def __init__(self, port: int):
        self.port = port
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
        )

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}") as r:
            return json.loads(r.read())

    def chat(self, content: str, **kw):
        return self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, **kw
        )

    def chat_text(self, content: str, stream: bool = False, **kw) -> str:
        if not stream:
            return self.chat(content, **kw).choices[0].message.content
        chunks = self.chat(content, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def complete_text(self, prompt: str, stream: bool = False, **kw) -> str:
        r = self.client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, stream=stream, **kw
        )
        if not stream:
            return r.choices[0].text
        return "".join(c.choices[0].text for c in r if c.choices)


@pytest.fixture(scope="module")
def evicting():
    proc, port = start(EVICT)
    yield Server(port)
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def plain():
    proc, port = start([])
    yield Server(port)
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def stock():
    """mlx-lm's own server (ModelProvider, ResponseGenerator, APIHandler) in this process.
    mlx_lm.utils.load cannot read the embedded GGUF, so its loader gets kvfn_models.load;
    everything else is mlx-lm's."""
    import kvfn_models
    from mlx_lm import server as mlx_server
    from mlx_lm.models.cache import LRUPromptCache

    from kvfn.serving.server import parse_args

    saved = mlx_server.load, mlx_server.load_processor
    mlx_server.load = lambda path, **kw: (*kvfn_models.load(), {})
    mlx_server.load_processor = lambda model, config: None
    args = parse_args(["--model", "embedded", *COMMON])
    generator = mlx_server.ResponseGenerator(mlx_server.ModelProvider(args), LRUPromptCache(10))
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a, **k: mlx_server.APIHandler(generator, *a, **k)
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Server(httpd.server_address[1])
    httpd.shutdown()
    generator.stop_and_join()
    mlx_server.load, mlx_server.load_processor = saved


def document(topic: str, n: int = 24) -> str:
    facts = " ".join(f"The {topic} number {i} was painted {c}." for i, c in
                     zip(range(n), ["red", "blue", "green", "white"] * n))  # fmt: skip
    return f"{facts} What colour was the {topic} number 5?"


LONG = [document(t) for t in ("boat", "house", "kite", "train")]  # ~280-300 tokens each
SHORT = ["Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a colour."]


# -- eviction off: mlx-lm's output -------------------------------------------------------------
def test_eviction_off_matches_mlx_lm_server(plain, stock):
    for stream in (False, True):
        assert plain.chat_text(LONG[0], stream=stream) == stock.chat_text(LONG[0], stream=stream)
        assert plain.chat_text(SHORT[1], stream=stream) == stock.chat_text(SHORT[1], stream=stream)
        assert plain.complete_text("The capital of France is", stream=stream) == (
            stock.complete_text("The capital of France is", stream=stream)
        )
    r = plain.chat(LONG[1])
    assert "kv_eviction" not in (r.usage.model_extra or {})
    assert plain.get("/health")["kv_eviction"] == "none"


# -- eviction on ---------------------------------------------------------------------------------
def test_eviction_on_chat_and_completions(evicting):
    r = evicting.chat(LONG[0])
    kv = r.usage.model_extra["kv_eviction"]
    assert kv["policy"] == "snapkv"
    assert 0 < kv["rows_kept"] < kv["rows_total"]
    assert 0 < kv["bytes_kept"] < kv["bytes_total"]
    assert kv["rows_kept"] == 30 * 64  # 30 layers x the 64-row budget
    assert r.choices[0].message.content
    chunks = list(evicting.chat(LONG[0], stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    assert chunks[-1].usage.model_extra["kv_eviction"] == kv
    text = evicting.client.completions.create(
        model=MODEL, prompt=LONG[2], max_tokens=8, temperature=0
    )
    assert text.usage.model_extra["kv_eviction"]["rows_kept"] < text.usage.prompt_tokens * 30
    assert evicting.complete_text(LONG[2], stream=True, max_tokens=8) == text.choices[0].text
    short = evicting.chat(SHORT[0])
    assert short.usage.model_extra["kv_eviction"]["kept_whole"]  # under the floor


def test_a_warm_up_at_start_leaves_no_trace_but_its_kernels(evicting):
    """``--kv-warmup`` runs one synthetic request of the policy before the port serves: it is
    announced, leaves the prompt cache and the counters empty, and a request then answers as
    on a server that did not warm up."""
    proc, port = start([*EVICT, "--kv-warmup"])
    try:
        assert re.search(r"warmed up snapkv in [\d.]+ s \(a \d+-token prompt", proc.started[0])
        warm = Server(port)
        stats = warm.get("/health")["kv_cache"]
        assert stats["compacted_requests"] == 0
        assert stats["prompt_cache_sequences"] == stats["active_sequences"] == 0
        r, cold = warm.chat(LONG[1], max_tokens=8), evicting.chat(LONG[1], max_tokens=8)
        assert r.choices[0].message.content == cold.choices[0].message.content
        assert r.usage.model_extra["kv_eviction"] == cold.usage.model_extra["kv_eviction"]
    finally:
        proc.terminate()
        proc.wait(30)
    # a policy keeping every prompt the model takes (8,192 tokens) whole has nothing to warm
    proc, _ = start([*EVICT, "--kv-warmup", "--kv-min-tokens", "9000"])
    proc.terminate()
    proc.wait(30)
    assert len(proc.started) == 1 and "listening on" in proc.started[0]
    # under a cap, long enough for two chunks past it before the last (warm_up_tokens: 265)
    proc, _ = start([*EVICT, "--kv-warmup", "--kv-max-rows", "96", "--prefill-step-size", "64"])
    proc.terminate()
    proc.wait(30)
    tokens = int(re.search(r"\(a (\d+)-token prompt", proc.started[0]).group(1))
    assert 96 + 2 * 64 < tokens <= 265


@pytest.mark.parametrize("interval", [None, 16])
def test_a_warm_up_under_a_decode_interval_builds_its_first_compaction(interval, monkeypatch):
    """Under ``--kv-decode-interval N`` the warm-up decodes N tokens more, the end of text
    banned, so every layer compacts once while generating before a client's first long answer;
    without one it decodes its few tokens and compacts nothing while generating."""
    from kvfn.serving import interop, server

    flags = [*COMMON[2:], *EVICT, "--no-kv-warmup"]
    args = server.parse_args(flags + ([] if interval is None else
                                      ["--kv-decode-interval", str(interval)]))  # fmt: skip
    layers, compact = [], interop.Evicting.compact

    def counted(self, state):
        layers.append(self.layer)
        return compact(self, state)

    monkeypatch.setattr(interop.Evicting, "compact", counted)
    generator = server.make_generator(args)
    try:
        tokens, decoded, _ = server.warm_up(generator, args)
        n = len(generator.model_provider.model.layers)
        longest = generator.model_provider.context_length
    finally:
        generator.stop_and_join()
    assert tokens == server.warm_up_tokens(args.policy, longest, None, 512)
    assert decoded == server.WARM_UP_DECODE + (interval or 0)
    assert sorted(set(layers)) == ([] if interval is None else list(range(n)))


@pytest.mark.parametrize("max_rows,step,window", [(None, 64, 8), (96, 64, 8), (128, 64, 8),
                                                  (40, 16, 8), (96, 16, 32), (96, 16, 64)])
def test_a_capped_warm_up_builds_the_first_and_a_steady_compaction(max_rows, step, window,
                                                                   monkeypatch):
    """Under ``--kv-max-rows`` the warm-up prompt is long enough that two chunks pass the cap
    before the last: the first compaction while prefilling and a steady one (the cap plus a
    chunk, back to the cap) are both built before a client's first long prompt."""
    import mlx.core as mx

    import kvfn
    from kvfn import compaction
    from kvfn.serving.server import warm_up_tokens
    from tests.tiny import tiny_model

    fm = kvfn.FunctionalModel(tiny_model("llama"))
    policy = kvfn.SnapKV(budget=window + 24, window=window)
    n = warm_up_tokens(policy, 10_000, max_rows, step)
    assert not policy.keeps_whole(n - 1) and n <= 10_000
    assert warm_up_tokens(policy, 100, max_rows, step) <= 100  # never past the model's context
    uncapped = warm_up_tokens(policy, 10_000, None, step)
    assert warm_up_tokens(policy, 10_000, 20_000, step) == uncapped  # a cap no prompt passes
    held, compact = [], compaction._compacted

    def counted(states, *args, **kwargs):
        held.append((int(states[0].rows), kwargs.get("reserve")))
        return compact(states, *args, **kwargs)

    monkeypatch.setattr(compaction, "_compacted", counted)
    prompt = mx.array([[t % 97 for t in range(n)]])  # compacted but its last token, as served
    kvfn.compact(fm, prompt, policy, prefill_step_size=step, max_rows=max_rows)
    if max_rows is None:
        assert len(held) == 1  # once, after the prefill
    else:  # the first pass, a steady one (the cap and a chunk, room for a chunk), the last
        assert len(held) >= 3 and held[0][0] > max_rows
        assert held[1] == (max_rows + step, step)


def test_one_request_path_compacts_at_once(evicting):
    """A seed sends a request down mlx-lm's one-request path (``_serve_single``), where no
    batch generator runs the compaction's steps: it runs whole, and answers alike."""
    batched = evicting.chat(LONG[2], max_tokens=8)
    single = evicting.chat(LONG[2], max_tokens=8, seed=7)
    assert single.choices[0].message.content == batched.choices[0].message.content
    assert single.usage.model_extra["kv_eviction"] == batched.usage.model_extra["kv_eviction"]


def test_prompt_cache_reuse_rule(evicting):
    before = evicting.get("/health")["kv_cache"]
    first = evicting.chat(LONG[3])
    again = evicting.chat(LONG[3])
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # compacted fresh, not reused
    follow_up = evicting.client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6,
        messages=[{"role": "user", "content": LONG[3]},
                  {"role": "assistant", "content": first.choices[0].message.content},
                  {"role": "user", "content": "And number 6?"}],
    )  # fmt: skip
    assert follow_up.usage.prompt_tokens_details.cached_tokens == 0
    assert "kv_eviction" in follow_up.usage.model_extra
    after = evicting.get("/health")["kv_cache"]
    assert after["prompt_cache_lossy_entries"] == 0
    assert after["refused_prompt_cache_inserts"] >= before["refused_prompt_cache_inserts"] + 3
    # a short prompt's (lossless) cache is reused as mlx-lm reuses it
    evicting.chat(SHORT[2])
    reused = evicting.chat(SHORT[2])
    assert reused.usage.prompt_tokens_details.cached_tokens > 0
    assert reused.usage.model_extra["kv_eviction"]["kept_whole"]


# -- bad input -------------------------------------------------------------------------------------
def raw_post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    status, data = r.status, json.loads(r.read() or b"{}")
    conn.close()
    return status, data


@pytest.mark.parametrize(
    "kwargs, status, message",
    [
        (dict(model="no-such-model"), 404, "unknown model 'no-such-model'"),
        (dict(temperature="hot"), 400, "temperature must be of type"),
        (dict(max_tokens=-3), 400, "max_tokens must be at least 1"),
        (dict(max_tokens=10**9), 400, "exceeds the model's context of 8192"),
        (dict(max_tokens="ten"), 400, "max_tokens must be of type int"),
        (dict(extra_body={"kv_eviction": "no-such-policy"}), 400, "unknown policy"),
        (dict(extra_body={"kv_eviction": "duo-r25"}), 400,
         "duo needs a head pattern: start with --kv-head-pattern"),
        (dict(extra_body={"kv_eviction": "adakv"}), 400, "per-head rows in its own head parts"),
        (dict(extra_body={"kv_budget": 8}), 400, "budget 8 is below sink tokens + window = 4 + 8"),
        (dict(extra_body={"kv_budget": "big"}), 400, "kv_budget must be a positive integer"),
        (dict(messages="hello"), 400, "messages must be a non-empty list"),
        (dict(messages=[{"role": "user", "content": 7}]), 400, "cannot build a prompt"),
        (dict(messages=[{"role": "user", "content": "word " * 9000}]), 400, "exceeds the model"),
        (
            dict(
                messages=[{"role": "user", "content": "word " * 5000}],
                extra_body={"kv_eviction": "kvzip-c1"},
            ),
            400,
            "steps of the reconstruction pass",
        ),
    ],
)
def test_bad_input_is_a_4xx(evicting, kwargs, status, message):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        evicting.client.chat.completions.create(**kwargs)
    assert e.value.status_code == status
    assert message in e.value.response.json()["error"]
    assert evicting.get("/health")["status"] == "ok"


def test_malformed_json_and_then_serving(evicting):
    status, body = raw_post(evicting.port, "/v1/chat/completions", b'{"messages": [')
    assert status == 400 and "Invalid JSON" in body["error"]
    status, body = raw_post(evicting.port, "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON dictionary" in body["error"]
    assert evicting.complete_text("One, two,", max_tokens=3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-eviction", "snapkv", "--kv-budget", "16", "--kv-window", "32"],
         "--kv-budget: 16 is below --kv-sink-tokens + --kv-window = 4 + 32"),
        (["--kv-eviction", "nosuch"], "unknown policy 'nosuch'"),
        (["--model", "/no/such/model.gguf"], "no such model file"),
        (["--kv-eviction", "duo"], "duo needs a head pattern"),
        (["--kv-eviction", "duo", "--kv-head-pattern", "/no/such/pattern"], "no head pattern at"),
        (["--kv-eviction", "snapkv", "--kv-head-pattern", "."], "needs --kv-eviction duo"),
        (["--kv-head-pattern", "."], "needs --kv-eviction duo, got none"),
        (["--kv-eviction", ""], "--kv-eviction: must be a policy name or 'none', got ''"),
        (["--kv-eviction", "duo", "--kv-head-pattern", ".", "--kv-retrieval-ratio", "2"],
         "must be in [0, 1], got 2.0"),
    ],
)  # fmt: skip
def test_bad_startup_flags_exit_with_a_message(flags, message):
    r = subprocess.run([sys.executable, "-m", "kvfn.serving.server", "--port", "0", *flags], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0
    assert message in r.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt-cache-bytes", "-5"], "--prompt-cache-bytes: must be a size such as 500M or"),
        (["--prompt-cache-bytes", "5X"], "2GB, got '5X'"),
        (["--temp", "nan"], "--temp: must be a finite number, got nan"),
        (["--temp", "-1"], "--temp: must be >= 0, got -1.0"),
        (["--top-p", "5"], "--top-p: must be in [0, 1], got 5.0"),
        (["--top-k", "-3"], "--top-k: must be >= 0, got -3"),
        (["--min-p", "-1"], "--min-p: must be in [0, 1], got -1.0"),
        (["--kv-bits", "7"], "--kv-bits: invalid choice: 7"),
        (["--kv-bits", "0"], "--kv-bits: invalid choice: 0"),
        (["--kv-group-size", "-64"], "--kv-group-size: invalid choice: -64"),
        (["--quantized-kv-start", "-5"], "--quantized-kv-start: must be >= 0, got -5"),
        (["--num-draft-tokens", "-1"], "--num-draft-tokens: must be >= 0, got -1"),
        (["--port", "70000"], "--port: must be in [0, 65535], got 70000"),
        (["--chat-template-args", "[1,2]"], "--chat-template-args: must be a JSON object"),
        (["--chat-template-args", "{x"], "--chat-template-args: not valid JSON"),
        (["--kv-eviction", "snapkv", "--kv-retrieval-ratio", "0.5"],
         "--kv-retrieval-ratio: needs --kv-eviction duo, got snapkv"),
        (["--kv-recent-size", "8"], "--kv-recent-size: needs --kv-eviction duo, got none"),
    ],
)  # fmt: skip
def test_bad_sampling_and_cache_flags_are_refused_by_name(flags, message, capsys):
    from kvfn.serving.server import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_valid_flags_parse_as_mlx_lm_server_does():
    from kvfn.serving.server import parse_args

    want = dict(port=8080, temp=0.0, top_p=1.0, top_k=0, min_p=0.0, num_draft_tokens=3,
                kv_bits=None, kv_group_size=64, quantized_kv_start=5000, chat_template_args={},
                prompt_cache_bytes=None)  # fmt: skip
    defaults = vars(parse_args([]))
    assert {k: defaults[k] for k in want} == want
    flags = "--prompt-cache-bytes 1.5GB --kv-bits 4 --kv-group-size 128 --port 0".split()
    a = parse_args([*flags, "--chat-template-args", '{"enable_thinking": false}'])
    assert (a.prompt_cache_bytes, a.kv_bits, a.kv_group_size, a.port) == (1_500_000_000, 4, 128, 0)
    assert a.chat_template_args == {"enable_thinking": False}


def test_disconnect_frees_the_sequence_and_its_cache(evicting):
    idle = evicting.get("/health")["kv_cache"]
    assert idle["active_sequences"] == 0 and idle["active_bytes"] == 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG[1]}],
            "max_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", evicting.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    response = conn.getresponse()
    for _ in range(4):
        assert response.readline()  # the stream has started
    busy = evicting.get("/health")["kv_cache"]
    assert busy["active_sequences"] == 1 and busy["active_bytes"] > 0
    response.close()
    conn.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        held = evicting.get("/health")["kv_cache"]
        if held["active_sequences"] == 0:
            break
        time.sleep(0.2)
    assert held["active_sequences"] == 0 and held["active_bytes"] == 0
    assert held["prompt_cache_bytes"] == idle["prompt_cache_bytes"]  # nothing stored from it


# -- load ------------------------------------------------------------------------------------------
def concurrently(server: Server, fn, args, threads: int) -> tuple[list, int]:
    """``fn`` over ``args`` from ``threads`` clients at once, and the most sequences the
    server held at one time meanwhile."""
    peak = {"sequences": 0}

    def watch(stop):
        while not stop.is_set():
            held = server.get("/health")["kv_cache"]
            peak["sequences"] = max(peak["sequences"], held["active_sequences"])
            time.sleep(0.05)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(fn, args))
    finally:
        stop.set()
        watcher.join()
    return results, peak["sequences"]


def test_sixteen_concurrent_clients_match_each_request_alone(evicting):
    jobs = [(p, s) for p in LONG + SHORT for s in (False, True)]
    alone = {job: evicting.chat_text(job[0], stream=job[1], max_tokens=8) for job in jobs}

    def client(i):
        mine = [jobs[(i + k) % len(jobs)] for k in range(3)]  # long and short, stream or not
        return [(job, evicting.chat_text(job[0], stream=job[1], max_tokens=8)) for job in mine]

    results, peak = concurrently(evicting, client, range(16), 16)
    results = [r for rs in results for r in rs]
    assert len(results) == 48
    for job, text in results:
        assert text == alone[job], job
    assert peak > 1  # eviction on, requests still batched


# -- a compaction interleaved with the other streams' decoding ----------------------------------
BIG = document("lamp", 150)  # ~1.6K tokens: 7 prefill chunks of 256, then the compaction
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a long answer, no early end


@pytest.fixture(scope="module")
def interleaving():
    proc, port = start(EVICT + ["--prefill-step-size", "256"])
    yield Server(port)
    proc.terminate()
    proc.wait(30)


def arrivals(chunks, started: Optional[threading.Event] = None) -> tuple[str, list[float]]:
    """A stream's text and the arrival time of each chunk that carries some; ``started`` is
    set once three have arrived."""
    text, times = "", []
    for c in chunks:
        if not c.choices:
            continue
        choice = c.choices[0]
        piece = choice.delta.content if hasattr(choice, "delta") else choice.text
        if piece:
            text += piece
            times.append(time.perf_counter())
            if started is not None and len(times) == 3:
                started.set()
    return text, times


def counting(server: Server, started: Optional[threading.Event] = None):
    chunks = server.client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=48,
                                              temperature=0, stream=True)  # fmt: skip
    return arrivals(chunks, started)


def idle(server: Server) -> dict:
    """/health's kv_cache once the server holds no sequence (or after 60 s)."""
    deadline = time.time() + 60
    while True:
        held = server.get("/health")["kv_cache"]
        if held["active_sequences"] == 0 or time.time() > deadline:
            return held
        time.sleep(0.2)


def test_a_compaction_does_not_stall_the_other_streams(interleaving):
    server = interleaving
    before = idle(server)
    decoded_alone, _ = counting(server)
    compacted_alone = server.chat_text(BIG, max_tokens=8)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(counting, server, started)
        assert started.wait(120)
        sent = time.perf_counter()
        compacted, (first, *_) = arrivals(server.chat(BIG, max_tokens=8, stream=True))
        decoded, times = decoding.result()
    assert decoded == decoded_alone and compacted == compacted_alone
    # the gaps between the decoding stream's tokens from the compaction's start to its end
    after = [i for i, t in enumerate(times) if t > first]
    assert after, "the decoding stream ended before the compaction did"
    start, end = next(i for i, t in enumerate(times) if t >= sent), after[0]
    gaps = [b - a for a, b in zip(times[start - 1 : end], times[start : end + 1])]
    assert end - start >= 3  # tokens came while the compaction ran
    assert max(gaps) < (first - sent) / 3, (gaps, first - sent)
    held = idle(server)
    assert held["active_bytes"] == 0
    assert held["compacted_requests"] == before["compacted_requests"] + 2


def test_a_scoring_pass_runs_chunk_by_chunk(evicting):
    """KVzip's reconstruction pass (``kvzip-c64``: 64 context tokens a step) is advanced a chunk
    a step after the prefill's, each reaching the client as a keepalive, and answers as the
    pass run whole (the one-request path) does."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG[0]}], "max_tokens": 8,
            "temperature": 0, "stream": True, "kv_eviction": "kvzip-c64"}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", evicting.port, timeout=300)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    response = conn.getresponse()
    lines = []
    while not lines or lines[-1] != "data: [DONE]":
        lines.append(response.readline().decode().strip())
    conn.close()
    found = re.findall(r": keepalive (\d+)/(\d+)", "\n".join(lines))
    progress = [(int(done), int(total)) for done, total in found]
    P = progress[0][1]  # the context: one prefill chunk of 512
    passes = [(P + min(k * 64, P), 2 * P) for k in range(1, -(-P // 64) + 1)]
    # then the eviction's step, and mlx-lm's own as the last prompt token joins its batch
    assert progress == [(P, P), *passes, (2 * P, 2 * P), (1, 1)]
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in lines if line.startswith("data: {"))  # fmt: skip
    whole = evicting.chat(LONG[0], max_tokens=8, seed=7, extra_body={"kv_eviction": "kvzip-c64"})
    assert streamed == whole.choices[0].message.content
    assert whole.usage.model_extra["kv_eviction"]["policy"] == "kvzip"


def test_a_client_leaving_mid_compaction_drops_its_job(interleaving):
    server = interleaving
    before = idle(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": BIG}], "max_tokens": 8,
            "temperature": 0, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body))
    response = conn.getresponse()
    assert response.readline().startswith(b": keepalive 256/")  # mlx-lm's prefill keepalive
    busy = server.get("/health")["kv_cache"]
    assert busy["compacting_sequences"] == 1 and busy["active_sequences"] == 1
    assert busy["active_bytes"] > 0
    response.close()
    conn.close()
    held = idle(server)
    assert held["active_sequences"] == 0 and held["compacting_sequences"] == 0
    assert held["active_bytes"] == 0
    assert held["compacted_requests"] == before["compacted_requests"]  # dropped, not finished


# -- DuoAttention: per-head caches under continuous batching -------------------------------------
DUO_RECENT = 64


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    import numpy as np

    import kvfn

    folder = tmp_path_factory.mktemp("pattern")
    scores = np.random.default_rng(0).random((30, 3))
    return kvfn.HeadPattern(scores=scores, sink_size=4, recent_size=DUO_RECENT).save(folder)


@pytest.fixture(scope="module")
def duo(pattern):
    proc, port = start(["--kv-eviction", "duo", "--kv-head-pattern", str(pattern),
                        "--kv-retrieval-ratio", "0.34"])  # fmt: skip
    yield Server(port)
    proc.terminate()
    proc.wait(30)


def kvfn_answer(policy, content: str, max_tokens: int) -> str:
    """The answer kvfn's own decode gives over ``policy``'s compacted prompt (oracle-tested in
    test_duo), in this process."""
    import kvfn_models

    import kvfn
    from kvfn_eval.evaluator import kvfn_greedy

    model, tokenizer = kvfn_models.load()
    fm = kvfn.FunctionalModel(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True)  # fmt: skip
    policy = policy.for_tokenizer(tokenizer)  # KVzip's instructions, as the server sets them
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=max_tokens)
    (out,) = kvfn_greedy(fm, ids[-1:], states, max_tokens, set(tokenizer.eos_token_ids))
    return tokenizer.decode(out)


def kvfn_duo_answer(pattern, content: str, max_tokens: int) -> str:
    import kvfn

    policy = kvfn.Duo.from_pattern(kvfn.HeadPattern.load(pattern), ratio=0.34)
    return kvfn_answer(policy, content, max_tokens)


def while_decoding(server: Server, request):
    """``request()``'s result while another stream decodes a long answer, that stream's text,
    and its inter-token gaps (s) from the request's start to its end."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(counting, server, started)
        assert started.wait(120)
        sent = time.perf_counter()
        result = request()
        done = time.perf_counter()
        text, times = decoding.result()
    during = [t for t in times if sent <= t <= done]
    return result, text, [b - a for a, b in zip(during, during[1:])]


def test_duo_serves_kvfn_duo_answers(duo, pattern):
    alone, _ = counting(duo)
    r, decoded, gaps = while_decoding(duo, lambda: duo.chat(LONG[0], max_tokens=12))
    assert decoded == alone and len(gaps) >= 2, gaps  # the other stream kept decoding
    assert r.choices[0].message.content == kvfn_duo_answer(pattern, LONG[0], 12)
    kv = r.usage.model_extra["kv_eviction"]
    assert kv["policy"] == "duo" and 0 < kv["bytes_kept"] < 0.6 * kv["bytes_total"]
    health = duo.get("/health")
    assert health["kv_settings"]["retrieval_heads"] == "31/90"
    assert health["kv_settings"]["recent"] == DUO_RECENT
    assert health["kv_cache"]["prompt_cache_sequences"] == 0  # rule 4: never inserted
    short = duo.chat(SHORT[1], max_tokens=8)
    assert short.choices[0].message.content and short.usage.model_extra["kv_eviction"]["kept_whole"]
    # a plain policy per request, held in the server's head parts
    snap = duo.chat(LONG[0], max_tokens=8, extra_body={"kv_eviction": "snapkv", "kv_budget": 64})
    assert snap.usage.model_extra["kv_eviction"]["rows_kept"] == 30 * 64


def test_duo_concurrent_clients_match_each_request_alone(duo):
    jobs = LONG[:3] + SHORT[:3]
    alone = {job: duo.chat_text(job, max_tokens=8) for job in jobs}
    together, peak = concurrently(duo, lambda job: duo.chat_text(job, max_tokens=8), jobs * 2, 6)
    assert together == [alone[job] for job in jobs * 2]
    assert peak > 1  # per-head caches, still batched
    assert duo.get("/health")["kv_cache"]["active_sequences"] == 0


def test_ragged_policies_are_served_as_kvfn_decodes_them():
    """A server of a ragged policy (adakvzip-global: KVzip's pass, the pair-level plan, ragged
    rows in one batch cache a layer) answers as kvfn's own decode of the same prompt while
    another stream keeps decoding; a request may name another ragged policy or a plain one,
    not a policy of head parts; nothing stays held."""
    import kvfn

    proc, port = start(["--kv-eviction", "adakvzip-global", "--kv-budget", "64", "--kv-window",
                        "8", "--prefill-step-size", "128"])  # fmt: skip
    try:
        server = Server(port)
        alone, _ = counting(server)
        r, decoded, gaps = while_decoding(server, lambda: server.chat(LONG[1], max_tokens=10))
        assert decoded == alone and len(gaps) >= 2, gaps  # the other stream kept decoding
        policy = kvfn.parse_policy("adakvzip-global", budget=64, window=8)
        assert r.choices[0].message.content == kvfn_answer(policy, LONG[1], 10)
        kv = r.usage.model_extra["kv_eviction"]
        assert kv["policy"] == "adakvzip" and kv["bytes_kept"] < 0.4 * kv["bytes_total"]
        ada = server.chat(LONG[2], max_tokens=8, extra_body={"kv_eviction": "adakv"})
        want = kvfn_answer(kvfn.AdaKV(budget=64, window=8, sink_tokens=4), LONG[2], 8)
        assert ada.choices[0].message.content == want
        snap = server.chat(LONG[2], max_tokens=8, extra_body={"kv_eviction": "snapkv"})
        assert snap.usage.model_extra["kv_eviction"]["rows_kept"] == 30 * 64
        assert server.chat_text(SHORT[0], max_tokens=4)
        with pytest.raises(openai.BadRequestError) as refused:
            server.chat(LONG[0], max_tokens=4, extra_body={"kv_eviction": "duo"})
        assert "duo needs a head pattern" in refused.value.response.json()["error"]
        held = idle(server)
        assert held["active_bytes"] == 0 and held["prompt_cache_lossy_entries"] == 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_ragged_request_on_a_plain_server_is_refused(evicting):
    with pytest.raises(openai.BadRequestError) as refused:
        evicting.chat(LONG[0], max_tokens=4, extra_body={"kv_eviction": "adakvzip"})
    assert "per-head rows in its own" in refused.value.response.json()["error"]
