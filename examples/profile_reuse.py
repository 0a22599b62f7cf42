"""Where a later question on a reused context spends its time to the first token: kvfn-server with
a query-agnostic policy (the context compacted at the first question, reused after it) and the
same server without eviction (mlx-lm's lossless prompt cache), both in this process, each
question of an evaluation sample sent as benchmark_reuse.py sends it, while a sampling profiler
reads the generation thread's stack every --every seconds during questions 2-N.

python examples/profile_reuse.py --tokens 1500 --questions 4               # embedded, CPU
python examples/profile_reuse.py --model M --tokens 8192 --prefill-step-size 2048   # the GPU

Per server: questions 2-N's mean time to the first token, then the functions the generation
thread was in (inclusive: a function counts in every sample whose stack holds it) as ms per
question, and the innermost kvfn / mlx-lm / mlx frames (self time; a wait for the GPU shows as the
line that evaluates).
"""

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import kvfn  # noqa: E402,F401  (puts OpenBLAS in front before mlx loads)
from benchmark_reuse import NONE, load_tokenizer, make_context, server_flags, turn  # noqa: E402

OURS = ("/kvfn/", "/mlx_lm/", "/mlx/", "/examples/")


class Sampler:
    """Samples one thread's stack while ``on`` (a thread of its own)."""

    def __init__(self, every: float):
        self.every, self.on, self.ident = every, False, None
        self.inclusive, self.innermost = collections.Counter(), collections.Counter()
        self.samples, self.seconds = 0, 0.0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        last = time.perf_counter()
        while True:
            time.sleep(self.every)
            now = time.perf_counter()
            frame = sys._current_frames().get(self.ident) if self.on else None
            if frame is not None:
                self._record(frame)
                self.seconds += now - last
            last = now

    def _record(self, frame):
        names, inner = [], None
        while frame is not None:
            code = frame.f_code
            where = code.co_filename
            if inner is None and any(p in where for p in OURS):
                inner = f"{Path(where).name}:{frame.f_lineno} {code.co_name}"
            names.append(f"{Path(where).name} {code.co_name}")
            frame = frame.f_back
        self.samples += 1
        self.inclusive.update(set(names))
        self.innermost[inner or names[0]] += 1

    def report(self, questions: int, top: int) -> list:
        per = self.seconds / max(self.samples, 1) * 1000 / max(questions, 1)  # ms a sample, a q
        rows = [f"  inclusive ms/question ({self.samples} samples)"]
        rows += [f"  {n * per:9.1f}  {name}" for name, n in self.inclusive.most_common(top)]
        rows += ["  innermost ms/question"]
        rows += [f"  {n * per:9.1f}  {name}" for name, n in self.innermost.most_common(top)]
        return rows


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or mlx-lm folder (default: embedded SmolLM2)")
    p.add_argument("--task", default="niah_multikey")
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--policy", default="adakvzip-global")
    p.add_argument("--budget", type=float, default=0.125)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--every", type=float, default=0.002, help="seconds between samples")
    p.add_argument("--top", type=int, default=25)
    return p.parse_args(argv)


def serve(flags: list):
    from kvfn.serving import server as kv_server

    args = kv_server.parse_args(["--port", "0", "--log-level", "ERROR", *flags])
    httpd, generator = kv_server.make_server(args)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, generator, f"http://127.0.0.1:{httpd.server_address[1]}"


def main(argv=None) -> dict:
    import kvfn_eval.tasks as tasks
    from kvfn_eval.evaluator import token_counter

    args = parse(argv)
    tokenizer = load_tokenizer(args.model)
    count = token_counter(tokenizer)
    budget = args.budget if args.budget < 1 else int(args.budget)

    def sample(seed):
        made = tasks.generate(args.task, seed=seed, target_tokens=args.tokens - args.max_tokens,
                              count_tokens=count, n_questions=args.questions)  # fmt: skip
        return make_context(tokenizer, made, budget)

    warm, ctx = sample(-1), sample(0)
    out = {}
    for name, f in server_flags(args, ctx.rows).items():
        httpd, generator, url = serve(f)
        sampler = Sampler(args.every)
        sampler.ident = generator._generation_thread.ident
        try:
            for q in range(2):
                turn(url, warm, q, name != NONE, args.max_tokens)
            ttft = []
            for q in range(len(ctx.texts)):
                sampler.on = q > 0
                got = turn(url, ctx, q, name != NONE, args.max_tokens)
                sampler.on = False
                ttft.append(got["ttft"])
        finally:
            httpd.shutdown()
            httpd.server_close()
            generator.stop_and_join()
        later = sum(ttft[1:]) / max(len(ttft) - 1, 1)
        out[name] = dict(first=ttft[0], later=later)
        print(f"\n{name}: {ctx.n}-token context, question 1 {ttft[0]:.3f} s, questions 2-"
              f"{len(ttft)} {later:.3f} s to the first token")  # fmt: skip
        print("\n".join(sampler.report(len(ttft) - 1, args.top)), flush=True)
    return out


if __name__ == "__main__":
    main()
