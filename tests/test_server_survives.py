"""kvfn-server survives every request: every registered policy through it, one request's failure
its own, a client that leaves stops its work, and a seeded mix of all of these.

Servers run in this process (``make_server`` on a thread, the embedded model loaded once), so a
test can register a policy of its own or break a step of the generation loop.
"""

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np
import pytest

import kvfn
from kvfn.policies.policy import POLICIES as REGISTRY
from kvfn.serving import server as kv_server

COMMON = ["--port", "0", "--prefill-step-size", "128", "--max-tokens", "8", "--log-level",
          "CRITICAL", "--prompt-cache-size", "64"]  # fmt: skip
BUDGET = ["--kv-budget", "64", "--kv-window", "8"]


def document(topic: str, n: int = 14) -> str:
    facts = " ".join(f"The {topic} number {i} was painted {c}." for i, c in
                     zip(range(n), ["red", "blue", "green", "white"] * n))  # fmt: skip
    return f"{facts} What colour was the {topic} number 5?"


DOC = document("boat")  # ~170 tokens: compacted at a budget of 64, kept whole at 4096


@pytest.fixture(scope="module")
def loaded():
    """The embedded model, loaded once for every server of this module."""
    import kvfn_models

    pair = kvfn_models.load()
    saved = kvfn_models.load
    kvfn_models.load = lambda *a, **k: pair
    yield pair
    kvfn_models.load = saved


class Served:
    """An in-process kvfn-server and plain HTTP calls to it."""

    def __init__(self, flags: list[str]):
        args = kv_server.parse_args([*COMMON, *flags])
        self.httpd, self.generator = kv_server.make_server(args)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.generator.stop_and_join()

    def post(self, body: dict, path: str = "/v1/chat/completions", timeout: float = 300):
        """(status, parsed body or the stream's events)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps(body),
                         headers={"Content-Type": "application/json"})  # fmt: skip
            r = conn.getresponse()
            data = r.read().decode()
        finally:
            conn.close()
        if body.get("stream") and r.status == 200:
            return r.status, [json.loads(line[6:]) for line in data.splitlines()
                              if line.startswith("data: {")]  # fmt: skip
        return r.status, json.loads(data)

    def get(self, path: str):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def idle(self, within: float = 60) -> dict:
        """/metrics once nothing is active (or after ``within`` s)."""
        deadline = time.time() + within
        while True:
            _, held = self.get("/metrics")
            if held["active_sequences"] == 0 or time.time() > deadline:
                return held
            time.sleep(0.1)


def chat(content: str = DOC, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, **kw}  # fmt: skip


def text(status_body) -> str:
    status, body = status_body
    assert status == 200, body
    if isinstance(body, list):
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in body
                       if e.get("choices"))  # fmt: skip
    return body["choices"][0]["message"]["content"]


@pytest.fixture
def serve(loaded):
    servers = []

    def start(flags):
        servers.append(Served(flags))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def pattern(tmp_path_factory):
    scores = np.random.default_rng(0).random((30, 3))
    folder = tmp_path_factory.mktemp("pattern")
    return kvfn.HeadPattern(scores=scores, sink_size=4, recent_size=32).save(folder)


# -- every registered policy through the server -------------------------------------------------
LIBRARY = sorted(n for n, cls in REGISTRY.items() if cls.__module__.startswith("kvfn.policies."))


def option_names(name: str) -> list[str]:
    """Each option word of a registered policy's name, and each number option at the field's
    default (``snapkv-avg``, ``snapkv-k7``, ...)."""
    cls = REGISTRY[name]
    defaults = cls.settings()  # a shorthand's: its scorer's too
    numbers = [f"{p}{defaults[f]}" for p, f in cls.numbers.items()
               if isinstance(defaults.get(f), int) and defaults[f] > 0]  # fmt: skip
    return [f"{name}-{w}" for w in [*cls.words, *numbers]]


def server_flags(name: str, pattern) -> list[str]:
    duo = ["--kv-head-pattern", str(pattern), "--kv-retrieval-ratio", "0.34"]
    return ["--kv-eviction", name, *BUDGET, *(duo if name == "duo" else [])]


def own_answer(loaded, policy, content: str, max_tokens: int, **compact) -> str:
    """What kvfn's own decode answers over ``policy``'s compaction of the chat prompt."""
    from kvfn_eval.evaluator import kvfn_greedy

    model, tokenizer = loaded
    fm = kvfn.FunctionalModel(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                        add_generation_prompt=True)  # fmt: skip
    policy = policy.for_tokenizer(tokenizer)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=max_tokens, **compact)
    (out,) = kvfn_greedy(fm, ids[-1:], states, max_tokens, set(tokenizer.eos_token_ids))
    return tokenizer.decode(out)


@pytest.mark.parametrize("name", LIBRARY)
def test_every_policy_is_served_as_the_servers_and_by_request(serve, loaded, pattern, name):
    """As the server's policy: its name and every option word answer 200 with their usage,
    below the prompt (compacted, as kvfn's own decode answers) and above it (kept whole).
    Then every other registered name by request: 200, or a 4xx naming why (per-head rows in
    other head parts). The server stays healthy throughout."""
    server = serve(server_flags(name, pattern))
    below = server.post(chat())
    args = kv_server.parse_args([*COMMON, *server_flags(name, pattern)])
    assert text(below) == own_answer(loaded, args.policy, DOC, 6)
    usage = below[1]["usage"]["kv_eviction"]
    assert usage["policy"] == name and not usage["kept_whole"]
    assert usage["bytes_kept"] < usage["bytes_total"]
    status, whole = server.post(chat(kv_budget=4096))
    assert status == 200, whole
    kept = whole["usage"]["kv_eviction"]
    if name == "duo":  # its streaming heads keep sinks and recent rows, whatever the budget
        assert not kept["kept_whole"] and kept["rows_kept"] < kept["rows_total"]
    else:
        assert kept["kept_whole"] and kept["rows_kept"] == kept["rows_total"] > 0
    for option in option_names(name):
        status, body = server.post(chat(kv_eviction=option, max_tokens=2))
        assert status == 200, (option, body)
        assert not body["usage"]["kv_eviction"]["kept_whole"], option
    for other in LIBRARY:
        status, body = server.post(chat(kv_eviction=other, max_tokens=2))
        if status == 200:
            assert body["usage"]["kv_eviction"]["policy"] == other
        else:
            assert status == 400 and other in body["error"], (other, body)
    assert server.get("/health")[1]["status"] == "ok"
    held = server.idle()
    assert held["active_bytes"] == 0 and held["compacting_sequences"] == 0


def test_a_request_caps_the_rows_held_while_prefilling(serve, loaded, capsys):
    """``kv_max_rows`` (or ``--kv-max-rows``): the compaction evicts while it prefills, its peak
    in the usage, answering as kvfn's own ``compact(max_rows=...)``; a cap below the budget, a
    policy that cannot and a server without eviction are 400s that say why."""
    server = serve(["--kv-eviction", "snapkv", *BUDGET, "--kv-max-rows", "64"])
    body = server.post(chat(max_tokens=6))
    usage = body[1]["usage"]["kv_eviction"]
    assert usage["peak_rows"] <= 64 + 128 + 8 and not usage["kept_whole"]
    policy = kvfn.SnapKV(budget=64, window=8)
    assert text(body) == own_answer(loaded, policy, DOC, 6, max_rows=64, prefill_step_size=128)
    long = document("boat", 60)  # ~700 tokens: the cap holds well below them
    usage = server.post(chat(long, kv_max_rows=96, max_tokens=2))[1]["usage"]["kv_eviction"]
    assert usage["peak_rows"] <= 96 + 128 + 8 < 600
    assert "peak_rows" not in server.post(chat(kv_max_rows=None))[1]["usage"]["kv_eviction"]
    for bad, why in (
        (32, "max_rows must be an int >= the policy's budget 64, got 32"),
        (True, "max_rows must be an int"),
        ("64", "max_rows must be an int"),
    ):
        status, out = server.post(chat(kv_max_rows=bad))
        assert status == 400 and why in out["error"], out
    status, out = server.post(chat(long, kv_max_rows=96, kv_eviction="kvzip", max_tokens=2))
    assert status == 200 and out["usage"]["kv_eviction"]["peak_rows"] <= 96 + 128 + 8, out
    status, out = server.post(chat(kv_max_rows=64, kv_eviction="pyramidkv"))
    assert status == 400 and "pyramidkv cannot evict while prefilling" in out["error"], out
    plain = serve([])
    status, out = plain.post(chat(kv_max_rows=64))
    assert status == 400 and "kv_max_rows needs a kv_eviction policy" in out["error"], out
    with pytest.raises(SystemExit):
        kv_server.parse_args(
            [*COMMON, "--kv-eviction", "pyramidkv", *BUDGET, "--kv-max-rows", "64"]
        )
    assert server.get("/health")[1]["kv_settings"]["max_rows"] == 64
    status, out = server.post(chat(kv_probe=True, max_tokens=6))
    assert status == 200 and out["usage"]["kv_eviction"]["probe"] is True, out
    probed = own_answer(loaded, policy, DOC, 6, max_rows=64, prefill_step_size=128, probe=True)
    assert text((status, out)) == probed != text(body)  # the question chose other rows
    usage = server.post(chat(kv_probe=True, kv_max_rows=4096))[1]["usage"]["kv_eviction"]
    assert "probe" not in usage and "peak_rows" in usage  # no compaction while prefilling
    assert plain.post(chat(kv_probe=False))[0] == 200  # off needs no policy
    for bad, why in (
        (chat(kv_probe="yes"), "kv_probe must be true or false, got 'yes'"),
        (chat(kv_probe=True, kv_max_rows=None), "kv_probe scores the compactions while"),
        (chat(kv_probe=True, kv_eviction="streaming"), "'streaming' is not scored by an"),
        (chat(kv_probe=True, kv_eviction="pyramidkv"), "pyramidkv cannot evict while prefilling"),
    ):
        status, out = server.post(bad)
        assert status == 400 and why in out["error"], out
    capsys.readouterr()
    for flags, why in (
        (["--kv-probe"], "argument --kv-probe: needs --kv-max-rows R"),
        (["--kv-max-rows", "64", "--kv-probe", "--kv-eviction", "kvzip"],
         "argument --kv-probe: probe reads the prompt's last window to score what 'kvzip'"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            kv_server.parse_args([*COMMON, "--kv-eviction", "snapkv", *BUDGET, *flags])
        assert why in capsys.readouterr().err


def test_layer_steps_answer_as_kvfn_and_are_refused_below_one(serve, loaded):
    """``--kv-step-layers``: a compaction's forwards are evaluated a few layers a step (the
    other streams wait less a step); kvzip's and snapkv's answers are kvfn's own."""
    for name in ("snapkv", "kvzip"):
        flags = ["--kv-eviction", name, *BUDGET, "--kv-step-layers", "7"]
        server = serve(flags)
        policy = kv_server.parse_args([*COMMON, *flags]).policy
        assert text(server.post(chat())) == own_answer(loaded, policy, DOC, 6), name
    for bad in ("0", "-2", "1.5"):
        with pytest.raises(SystemExit):
            kv_server.parse_args([*COMMON, "--kv-eviction", "snapkv", "--kv-step-layers", bad])


def test_a_request_evicts_while_generating(serve, loaded):
    """``kv_decode_interval`` (or ``--kv-decode-interval``): every N generated tokens the rows go
    back to the budget, and the answer is kvfn's own ``bounded_decode``'s, beside a request that
    does not evict (batched with it); what cannot evict while generating is a 400 that says why."""
    model, tokenizer = loaded
    server = serve(["--kv-eviction", "snapkv", *BUDGET, "--kv-decode-interval", "16"])
    long = document("boat", 30).rsplit(" What", 1)[0] + " Write a long story about these boats."
    fm = kvfn.FunctionalModel(model)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": long}],
                                        add_generation_prompt=True)  # fmt: skip
    policy = kvfn.SnapKV(budget=64, window=8)
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=1, prefill_step_size=128)
    want, eos = [], set(tokenizer.eos_token_ids)
    for token in kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy, steps=72,
                                     interval=16):  # fmt: skip
        if token.item() in eos:
            break
        want.append(token.item())
    assert len(want) == 72  # long enough to compact four times while generating
    results = {}

    def ask(key, **kw):
        results[key] = server.post(chat(long, max_tokens=72, **kw))

    threads = [threading.Thread(target=ask, args=("evicting",)),
               threading.Thread(target=ask, args=("plain",), kwargs={"kv_decode_interval": None})]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert text(results["evicting"]) == tokenizer.decode(want)
    assert results["evicting"][1]["usage"]["kv_eviction"]["decode_interval"] == 16
    assert "decode_interval" not in results["plain"][1]["usage"]["kv_eviction"]
    assert text(results["plain"]) == own_answer(loaded, policy, long, 72, prefill_step_size=128)
    assert text(results["plain"]) != text(results["evicting"])  # the evictions changed it
    short = "Write a long story about boats."  # kept whole, then evicted while generating
    ids = tokenizer.apply_chat_template([{"role": "user", "content": short}],
                                        add_generation_prompt=True)  # fmt: skip
    states, _ = kvfn.compact(fm, ids, policy, max_new_tokens=1, prefill_step_size=128)
    tokens = [t.item() for t in kvfn.bounded_decode(fm, mx.array([[ids[-1]]]), states, policy,
                                                      steps=72, interval=16)]  # fmt: skip
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]
    got = server.post(chat(short, max_tokens=72))
    assert text(got) == tokenizer.decode(tokens) and got[1]["usage"]["kv_eviction"]["kept_whole"]
    for body, why in (
        (chat(kv_decode_interval=8), "interval must be an int > the policy's window 8, got 8"),
        (chat(kv_decode_interval="32"), "interval must be an int"),
        (chat(kv_eviction="kvzip", kv_decode_interval=32), "kvzip cannot evict while generating"),
    ):
        status, out = server.post(body)
        assert status == 400 and why in out["error"], out
    status, out = serve([]).post(chat(kv_decode_interval=32))
    assert status == 400 and "kv_decode_interval needs a kv_eviction policy" in out["error"], out
    assert server.get("/health")[1]["kv_settings"]["decode_interval"] == 16
    held = server.idle()
    assert held["active_bytes"] == 0 and held["compacting_sequences"] == 0


def test_pyramidkv_batched_with_other_streams_answers_as_alone(serve):
    """pyramidkv keeps a different number of rows in each layer: batched with other streams,
    each layer attends with its own mask, and every answer is the one it gives alone."""
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    jobs = [chat(kv_eviction="pyramidkv"), chat(document("kite"), kv_eviction="pyramidkv"),
            chat("Name a fruit."), chat(document("house"))]  # fmt: skip
    alone = [text(server.post(job)) for job in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = [text(r) for r in pool.map(server.post, jobs * 2)]
    assert together == alone * 2


# -- one request's failure is its own ------------------------------------------------------------
@dataclass(frozen=True)
class Failing(kvfn.Policy):
    """A policy whose scoring raises: ``bad-input`` a ValueError of its own checks, else a
    RuntimeError (a fault of the server's)."""

    name: ClassVar[str] = "failing"
    needs_scores: ClassVar[bool] = True
    words: ClassVar[dict] = {"input": {"window": 9}}

    def row_scores(self, scores, *, prompt_length, n_kv_heads, batch, layer):
        if self.window == 9:
            raise ValueError("failing-input: this prompt cannot be scored")
        raise RuntimeError("failing: the scoring broke")


kvfn.register_policy(Failing)


def test_a_failing_compaction_fails_its_request_alone(serve):
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    plain = [chat("Name a fruit."), chat(document("kite"))]
    alone = [text(server.post(job)) for job in plain]
    jobs = [chat(kv_eviction="failing"), *plain, chat(kv_eviction="failing-input"),
            chat(kv_eviction="failing", stream=True)]  # fmt: skip
    with ThreadPoolExecutor(5) as pool:
        broken, *served, bad, streamed = pool.map(server.post, jobs)
    assert broken[0] == 500 and "RuntimeError: failing: the scoring broke" in broken[1]["error"]
    assert bad[0] == 400 and "failing-input: this prompt cannot be scored" in bad[1]["error"]
    # a stream's 200 went out when it started: it ends with an error event
    assert streamed[0] == 200 and streamed[1][-1]["error"]["code"] == 500
    assert [text(r) for r in served] == alone
    assert server.get("/health")[1]["status"] == "ok"
    assert text(server.post(chat(kv_eviction="snapkv")))
    held = server.idle()
    assert held["active_bytes"] == 0 and held["compacting_sequences"] == 0


def test_a_failing_batched_step_fails_its_sequences_and_the_loop_goes_on(serve, monkeypatch):
    """A decode step of mlx-lm's batch raises (no one sequence can be blamed): the sequences in
    it answer 500, and the server serves the next requests."""
    from mlx_lm.generate import GenerationBatch

    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    want = text(server.post(chat("Name a fruit.")))
    step, broken = GenerationBatch.next, {"once": True}

    def next_once_broken(self):
        if broken.pop("once", False):
            raise RuntimeError("a decode step broke")
        return step(self)

    monkeypatch.setattr(GenerationBatch, "next", next_once_broken)
    status, body = server.post(chat(document("train")))
    assert status == 500 and "a decode step broke" in body["error"]
    assert text(server.post(chat("Name a fruit."))) == want
    assert server.get("/health")[1]["status"] == "ok"
    assert server.idle()["active_bytes"] == 0


def test_a_stopped_generation_thread_is_a_503_everywhere(serve, monkeypatch):
    server = serve(["--kv-eviction", "snapkv", *BUDGET])

    def broken(*a, **k):
        raise RuntimeError("the state machine broke")

    monkeypatch.setattr(server.generator, "_make_state_machine", broken)
    status, body = server.post(chat("Name a fruit."))
    assert status == 503 and "the state machine broke" in body["error"]
    status, health = server.get("/health")
    assert status == 503 and "RuntimeError: the state machine broke" in health["error"]
    for path in ("/v1/models", "/metrics"):
        assert server.get(path)[0] == 503
    status, body = server.post(chat("Name a colour."))
    assert status == 503 and "the state machine broke" in body["error"]


# -- a client that leaves stops its work ---------------------------------------------------------
BIG = document("lamp", 60)  # ~700 tokens: 6 prefill chunks of 128, then KVzip's pass


def leave_after(server: Served, body: dict, seconds: float, reads: int = 0) -> None:
    """Send ``body``, read ``reads`` lines of the response, wait, and close the connection."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
    lines = sock.makefile("rb")
    for _ in range(reads):
        lines.readline()
    time.sleep(seconds)
    sock.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_mid_compaction_stops_it(serve, stream):
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    before = server.idle()
    leave_after(server, chat(BIG, kv_eviction="kvzip", stream=stream), 1.0)
    tic = time.time()
    held = server.idle(within=30)
    assert time.time() - tic < 5, "the compaction ran on after its client left"
    assert held["compacting_sequences"] == 0 and held["active_bytes"] == 0
    assert held["compacted_requests"] == before["compacted_requests"]  # dropped, not finished


def test_a_client_leaving_a_long_answer_stops_its_decode(serve):
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    leave_after(server, chat(BIG, max_tokens=2000), 4.0)  # non-streaming: nothing read
    tic = time.time()
    assert server.idle(within=60)["active_sequences"] == 0
    assert time.time() - tic < 5, "the decode ran on after its client left"


def test_a_client_leaving_the_one_request_path_stops_its_compaction(serve):
    """A seed takes mlx-lm's one-request path, where the compaction runs whole at once: it
    stops between its steps all the same."""
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    before = server.idle()
    leave_after(server, chat(BIG, kv_eviction="kvzip", seed=3), 1.0)
    time.sleep(5)
    after = server.idle()
    assert after["compacted_requests"] == before["compacted_requests"]
    assert text(server.post(chat("Name a fruit.")))


# -- a seeded mix of everything ------------------------------------------------------------------
def chaos_requests(rng: random.Random, n: int) -> list[tuple[str, dict]]:
    """(kind, body): plain requests, every registered policy (bad ones too), streams, and a
    quarter that leave mid-way."""
    docs = [document(t) for t in ("boat", "kite", "lamp")]
    plain = [chat(d) for d in docs] + [chat("Name a fruit.")]
    policies = [n for n in LIBRARY if n not in ("adakv", "adakvzip", "duo")]
    bad = [chat(kv_eviction="no-such-policy"), chat(kv_eviction="snapkv-zz"),
           chat(kv_budget=0), chat(kv_budget=8), chat(kv_budget="big"),
           chat(kv_eviction="adakv"), chat(kv_eviction="duo")]  # fmt: skip
    out = []
    for i in range(n):
        kind = rng.choice(["plain", "plain", "policy", "policy", "bad"])
        if kind == "plain":
            body = dict(rng.choice(plain))
        elif kind == "policy":
            body = chat(rng.choice(docs), kv_eviction=rng.choice(policies))
        else:
            body = dict(rng.choice(bad))
        body["stream"] = rng.random() < 0.4
        out.append(("leave" if i % 4 == 3 else kind, body))
    return out


def test_chaos_the_server_stays_healthy_and_frees_everything(serve):
    """60 seeded requests, 6 at a time: every library policy a plain server serves, bad names
    and budgets, streams, and every fourth client leaving mid-way. The server stays healthy,
    every plain answer is the one it gives alone, and nothing stays held. Prints a summary
    (``pytest -s``)."""
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    jobs = chaos_requests(random.Random(55), 60)
    plain = {json.dumps(b, sort_keys=True) for k, b in jobs if k == "plain"}
    alone = {key: text(server.post(json.loads(key))) for key in plain}
    start = server.idle()
    rng = random.Random(7)

    def run(job):
        kind, body = job
        if kind == "leave":
            leave_after(server, body, rng.uniform(0.1, 1.5))
            return kind, body, None, None
        try:
            status, got = server.post(body, timeout=240)
        except (socket.timeout, TimeoutError):
            return kind, body, "hang", None
        return kind, body, status, got

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(run, jobs))
    held = server.idle(within=60)
    _, health = server.get("/health")
    statuses = [s for _, _, s, _ in results]
    summary = {
        "tried": len(results), "200": statuses.count(200),
        "4xx": sum(isinstance(s, int) and 400 <= s < 500 for s in statuses),
        "5xx": sum(isinstance(s, int) and s >= 500 for s in statuses),
        "left": statuses.count(None), "hangs": statuses.count("hang"),
        "thread_deaths": int(health["status"] != "ok"),
        "bytes_left": held["bytes_held"] - start["bytes_held"],
    }  # fmt: skip
    print("chaos:", summary)
    assert summary["hangs"] == summary["thread_deaths"] == summary["5xx"] == 0, summary
    for kind, body, status, got in results:
        if kind == "plain":
            assert text((status, got)) == alone[json.dumps(body, sort_keys=True)]
        elif kind == "policy":
            assert status == 200, (body, got)
        elif kind == "bad":
            assert status == 400, (body, got)
    assert held["active_sequences"] == held["compacting_sequences"] == 0
    assert summary["bytes_left"] == 0, (start, held)


def test_a_prompt_beside_a_compaction_gets_the_loop_first(monkeypatch):
    """While mlx-lm has other prompts to process, a compaction job steps only every JOB_EVERY-th
    loop step, so a short prompt that arrives during a long compaction is not slowed to the
    compaction's pace; with none waiting it steps every loop step, and it is never starved. A
    loop step runs the job's step first, then mlx-lm's. (The loop itself is stubbed: mlx-lm's
    step does nothing, the job counts its steps.)"""
    from collections import deque

    from mlx_lm.generate import BatchGenerator

    order = []
    monkeypatch.setattr(BatchGenerator, "_next", lambda self: order.append("mlx-lm") or ([], []))

    def steps():
        for s in range(10**6):
            order.append("job")
            yield s + 1, 10**6

    job = kv_server.PendingCompaction(steps(), nbytes=0)
    batch = type("Batch", (list,), {"uids": ()})
    gen = object.__new__(kv_server.TrackedBatchGenerator)
    gen._old_wired_limit, gen._jobs, gen._failed, gen._waited = None, deque(), {}, 0
    gen._jobs.append((0, [1], None, job))
    gen._generation_batch, gen._prompt_batch, gen.completion_batch_size = batch(), batch(), 4
    gen._counters = type("Counters", (), {"prompt_time": 0.0})()

    def run(n: int, waiting: bool) -> int:
        gen._unprocessed_sequences = deque([(1, [2], None, None)] if waiting else [])
        before = job.progress[0]
        for _ in range(n):
            gen._next()
        return job.progress[0] - before

    assert run(8, waiting=False) == 8  # alone: a step each
    assert order[:4] == ["job", "mlx-lm"] * 2  # the job's step before mlx-lm's, whose tokens
    assert run(12, waiting=True) == 12 // gen.JOB_EVERY  # go out without waiting for it
    assert run(4, waiting=False) == 4


def test_the_loop_takes_new_requests_every_poll_interval(monkeypatch):
    """mlx-lm's generation loop takes new requests only after 0.5 s of batch steps; kvfn's
    after REQUEST_POLL_S, set by the loop's own thread before it starts (a request that arrives
    during a long compaction joins at once: docs/serving.md has the figures)."""
    seen = []
    monkeypatch.setattr(kv_server.KVResponseGenerator, "_generate",
                        lambda self: seen.append(self._time_budget._budget))  # fmt: skip
    gen = kv_server.KVResponseGenerator(None, None)
    gen._generation_thread.join(10)
    assert seen == [kv_server.KVResponseGenerator.REQUEST_POLL_S] and seen[0] < 0.5
