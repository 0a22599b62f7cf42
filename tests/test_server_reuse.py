"""A context compacted once, asked many times, in kvfn-server's prompt cache (rule 5 of
``kvfn.serving.server``): with a query-agnostic policy a chat's messages before its last user
message are compacted once and kept; later requests on the same context prefill only their rest
over it. Servers run in this process, the embedded model loaded once."""

import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

import kvfn
from tests.test_server_survives import (  # noqa: F401
    BUDGET,
    document,
    leave_after,
    loaded,
    serve,
    text,
)

CONTEXT = document("kite", 40)  # ~480 tokens of facts, asked about in several turns
QUESTIONS = ("What colour was the kite number 5?", "What colour was the kite number 2?",
             "What colour was the kite number 7?")  # fmt: skip


def turn(question: str, context: str = CONTEXT, **kw) -> dict:
    messages = [{"role": "system", "content": context}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": 6, "temperature": 0, **kw}


def own_answer(loaded, policy, body: dict, n: int) -> str:
    """kvfn's library reuse: the first ``n`` prompt tokens compacted, the rest prefilled over
    them, then greedy decoding."""
    from kvfn_eval.evaluator import kvfn_greedy

    model, tokenizer = loaded
    fm = kvfn.FunctionalModel(model)
    ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    policy = policy.for_tokenizer(tokenizer)
    context, _ = kvfn.compact(fm, ids[:n], policy, max_new_tokens=0, prefill_step_size=128)
    states = kvfn.prefill(fm, mx.array([ids[n - 1 : -1]]), states=context, prefill_step_size=128)
    (out,) = kvfn_greedy(fm, ids[-1:], states, body["max_tokens"], set(tokenizer.eos_token_ids))
    return tokenizer.decode(out)


def usage(status_body) -> dict:
    status, body = status_body
    assert status == 200, body
    return {**body["usage"]["kv_eviction"], "cached": body["usage"]["prompt_tokens_details"]}


def test_a_shared_context_is_compacted_once_and_every_later_turn_reuses_it(serve, loaded):
    server = serve(["--kv-eviction", "kvzip", *BUDGET])
    first = usage(server.post(turn(QUESTIONS[0])))
    n = first["context_tokens"]
    assert not first["reused"] and first["cached"] == {"cached_tokens": 0} and n > 400
    for question in QUESTIONS[1:]:
        body = turn(question)
        out = server.post(body)
        again = usage(out)
        assert again["reused"] and again["cached"] == {"cached_tokens": n - 1}
        assert again["context_tokens"] == n and again["rows_kept"] == first["rows_kept"]
        assert text(out) == own_answer(loaded, kvfn.KVzip(budget=64, window=8), body, n)
    held = server.idle()
    assert held["compacted_requests"] == 1 and held["compacted_contexts"] == 1
    assert 0 < held["compacted_context_bytes"] <= held["bytes_held"]
    other = usage(server.post(turn(QUESTIONS[0], context=CONTEXT.replace("kite", "kiwi"))))
    assert not other["reused"] and server.idle()["compacted_contexts"] == 2  # exact keys only


def test_a_query_aware_compaction_is_never_reused(serve):
    server = serve(["--kv-eviction", "snapkv", *BUDGET])
    for question in QUESTIONS[:2]:
        got = usage(server.post(turn(question)))
        assert "reused" not in got and got["cached"] == {"cached_tokens": 0}
    held = server.idle()
    assert held["compacted_contexts"] == 0 and held["compacted_requests"] == 2
    status, body = server.post(turn(QUESTIONS[0], kv_context_tokens=100))
    assert status == 400 and "'snapkv' is not query-agnostic" in body["error"], body


def test_concurrent_turns_on_one_context_compact_it_once(serve):
    server = serve(["--kv-eviction", "kvzip", *BUDGET])
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda q: usage(server.post(turn(q))), QUESTIONS))
    assert sorted(o["reused"] for o in outs) == [False, True, True]
    held = server.idle()
    assert held["compacted_requests"] == 1 and held["compacted_contexts"] == 1


def test_a_client_leaving_the_first_compaction_leaves_no_half_context(serve):
    server = serve(["--kv-eviction", "kvzip", *BUDGET])
    leave_after(server, turn(QUESTIONS[0], stream=True), 1.0)
    tic = time.time()
    held = server.idle(within=30)
    assert time.time() - tic < 5 and held["compacting_sequences"] == 0
    assert held["compacted_contexts"] == 0 and held["compacted_requests"] == 0
    got = usage(server.post(turn(QUESTIONS[1])))
    assert not got["reused"] and server.idle()["compacted_contexts"] == 1


def test_an_explicit_context_and_bad_ones(serve, loaded):
    """``kv_context_tokens`` marks the shared context of any request (a completion too);
    a count outside the prompt is a 400 naming it."""
    server = serve(["--kv-eviction", "kvzip", *BUDGET])
    prompt = CONTEXT + " Which kite was red?"
    n = len(loaded[1].encode(prompt)) - 10  # a rest of about ten tokens
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "kv_context_tokens": n}
    first = usage(server.post(body, path="/v1/completions"))
    again = usage(server.post(body, path="/v1/completions"))
    assert (first["reused"], again["reused"]) == (False, True)
    assert again["cached"] == {"cached_tokens": n - 1}  # its last is prefilled with the rest
    for bad in (1, 10**6, "300", True):
        status, out = server.post(turn(QUESTIONS[0], kv_context_tokens=bad))
        assert status == 400 and "kv_context_tokens must be an int in [2, " in out["error"], out


def test_kept_contexts_are_dropped_least_recently_used_first(serve):
    """``--prompt-cache-size 1``: a second context drops the first, which is then compacted
    afresh, never served from the other; ``--prompt-cache-bytes`` below one compacted context
    keeps none."""
    server = serve(["--kv-eviction", "kvzip", *BUDGET, "--prompt-cache-size", "1"])
    other = CONTEXT.replace("kite", "kiwi")
    got = [usage(server.post(turn(q, context=c)))["reused"]
           for q, c in ((QUESTIONS[0], CONTEXT), (QUESTIONS[1], other), (QUESTIONS[2], CONTEXT))]  # fmt: skip
    assert got == [False, False, False]
    held = server.idle()
    assert held["compacted_contexts"] == 1 and held["compacted_requests"] == 3
    tight = serve(["--kv-eviction", "kvzip", *BUDGET, "--prompt-cache-bytes", "1000"])
    assert [usage(tight.post(turn(q)))["reused"] for q in QUESTIONS[:2]] == [False, False]
    assert tight.idle()["compacted_contexts"] == 0


def test_a_rest_longer_than_the_budget_is_compacted_with_its_context(serve):
    """Reusing a context holds the rest whole, so a rest over the budget (a long document in
    the last message) takes the plain compaction: the whole prompt to the budget, nothing
    kept; so does a rest that a ``kv_max_rows`` cap could not hold."""
    server = serve(["--kv-eviction", "kvzip", *BUDGET])
    long = usage(server.post(turn(document("kiwi", 20))))  # a context and a long rest
    assert "reused" not in long and long["rows_kept"] == 64 * 30
    assert server.idle()["compacted_contexts"] == 0


def test_a_servers_cap_leaves_requests_it_cannot_bound_uncapped(serve):
    """``--kv-max-rows``: requests whose policy or budget cannot take the server's cap run
    without it (an explicit ``kv_max_rows`` is still checked)."""
    server = serve(["--kv-eviction", "snapkv", *BUDGET, "--kv-max-rows", "96"])
    capped = usage(server.post(turn(QUESTIONS[0])))
    assert capped["peak_rows"] <= 96 + 128 + 8
    for body in ({"kv_eviction": "none"}, {"kv_eviction": "pyramidkv"}, {"kv_budget": 256}):
        status, out = server.post(turn(QUESTIONS[0], **body))
        assert status == 200, (body, out)
        assert "peak_rows" not in out["usage"].get("kv_eviction", {}), body
    status, out = server.post(turn(QUESTIONS[0], kv_eviction="pyramidkv", kv_max_rows=96))
    assert status == 400 and "pyramidkv cannot evict while prefilling" in out["error"]


def test_a_turn_waits_for_the_compaction_of_its_context_in_progress(loaded):
    """Two jobs on one context, advanced in turn: the second waits while the first compacts,
    then reuses what it kept; one compaction, one context."""
    from types import SimpleNamespace

    from kvfn.serving.server import EvictingPromptCache, KVModelProvider

    model, tokenizer = loaded
    fm = kvfn.FunctionalModel(model)
    policy = kvfn.StreamingLLM(budget=64)
    cli = SimpleNamespace(policy=policy, kv_max_rows=None, kv_probe=False,
                          kv_decode_interval=None, kv_step_layers=None, prefill_step_size=64,
                          prompt_cache_bytes=None)  # fmt: skip
    provider = KVModelProvider.__new__(KVModelProvider)  # what the prompt cache reads of one
    provider.__dict__.update(cli_args=cli, _functional=fm, tokenizer=tokenizer, ragged=False,
                             head_parts=None)  # fmt: skip
    cache = EvictingPromptCache(provider)
    context = tokenizer.encode(CONTEXT)
    prompts = [context + tokenizer.encode(" " + q) for q in QUESTIONS[:2]]
    first, second = (cache.reuse(p, policy, len(context)) for p in prompts)
    assert first.advance() is None and cache.compacting  # a prefill chunk of the context
    assert second.advance() is None and second.progress == (0, 1)  # it waits
    while first.advance() is None:
        assert second.advance() is None
    assert second.finish() and cache.compacted_requests == 1 and len(cache.contexts) == 1
    notes = [cache.evictions[(policy, tuple(p))]["reused"] for p in prompts]
    assert notes == [False, True] and not cache.compacting
