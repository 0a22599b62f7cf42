"""What one primitive of each kind costs the host, and the GPU: a compiled chain of N of them,
timed in three phases (as ``profile_decode.py --phases`` times a step).

    python examples/profile_host.py                    # every kind, chains of 128 and 256
    python examples/profile_host.py --kinds scatter custom-6k --lengths 256 512

build   calling the compiled chain: MLX replays its graph (an array per primitive)
encode  ``mx.async_eval``: the backend encodes every primitive (on CUDA, a graph node each)
wait    until the result is ready

Each figure is the median over ``--steps`` calls, as us per primitive: the difference between
the two chain lengths divided by their difference, so what a call costs once cancels. A
decode step is a few thousand primitives, so a kind that costs 1 us more a primitive costs a
32-layer step 32 us per use a layer. Kinds:

slice       a view of all but the first row (no kernel)
reshape     a view of another shape, and back (two a link; no kernel)
gather      ``take_along_axis`` with a permutation of 64 rows of 256
scatter     ``put_along_axis`` of one row (in place: each call's result is the next's input)
matmul      a (64, 256) x (256, 256) product
depends     ``mx.depends`` on another array (no kernel)
custom      an ``mx.fast.cuda_kernel`` adding one (CUDA only); ``custom-6k`` the same with a
            6 KB source, as long as kvfn's decode kernels' (MLX hashes it every call)
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvfn  # noqa: F401,E402  isort: skip  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402

from examples.benchmark_decode import check_at_least  # noqa: E402
from examples.profile_decode import phases_ms  # noqa: E402
from kvfn.kernels import cuda_kernel, on_cuda  # noqa: E402

ROWS, WIDTH = 64, 256
PHASES = ("build", "encode", "wait")


def _custom(padding: int):
    source = "int i = blockIdx.x * blockDim.x + threadIdx.x;\ny[i] = x[i] + 1.0f;\n"
    source += "// pad\n" * padding
    kernel = cuda_kernel(f"kvfn_host_probe_{padding}", ["x"], ["y"], source, header="")

    def step(x, aux):
        (y,) = kernel(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[x.dtype])  # fmt: skip
        return y

    return step


# each kind: a factory of the link (x, aux) -> x, called once a chain
KINDS = {
    "slice": lambda: lambda x, aux: x[1:],
    "reshape": lambda: lambda x, aux: x.reshape(-1, ROWS).reshape(ROWS, -1),
    "gather": lambda: lambda x, aux: mx.take_along_axis(x, aux["order"], axis=0),
    "scatter": lambda: lambda x, aux: mx.put_along_axis(x, aux["at"], aux["row"], axis=0),
    "matmul": lambda: lambda x, aux: x @ aux["w"],
    "depends": lambda: lambda x, aux: mx.depends(x, [aux["row"]]),
    "custom": lambda: _custom(0),
    "custom-6k": lambda: _custom(860),  # 860 lines of 7 bytes
}
PER_LINK = {"reshape": 2}  # primitives a link adds, where not one


def available(kind: str) -> bool:
    return not kind.startswith("custom") or on_cuda()


def chain(kind: str, n: int):
    """A compiled function of (x, aux) applying ``kind`` n times in a chain."""
    link = KINDS[kind]()

    def run(x, aux):
        for _ in range(n):
            x = link(x, aux)
        return x

    return mx.compile(run)


def _inputs(kind: str, n: int) -> tuple:
    rows = ROWS + n if kind == "slice" else ROWS  # a slice chain drops a row a link
    order = mx.array(list(range(1, ROWS)) + [0], mx.int32)[:, None]
    aux = {
        "order": mx.broadcast_to(order, (ROWS, WIDTH)),
        "at": mx.zeros((1, WIDTH), mx.int32),
        "row": mx.ones((1, WIDTH), mx.float32),
        "w": mx.full((WIDTH, WIDTH), 1e-3, mx.float32),
    }
    x = mx.zeros((rows, WIDTH), mx.float32)
    mx.eval(x, aux)
    return x, aux


def phases(kind: str, n: int, steps: int) -> list:
    """Median ms of build / encode / wait of a chain of n links (``profile_decode.phases_ms``).
    A chain that keeps its input's shape is fed its last result, so a scatter writes in place,
    as a decode loop's does."""
    fn, (x, aux) = chain(kind, n), _inputs(kind, n)
    box = [x]
    del x

    def build():
        y = fn(box[0], aux)
        if y.shape == box[0].shape:
            box[0] = y
        return y

    return phases_ms(build, steps)


def per_primitive(kind: str, lengths: tuple, steps: int) -> dict:
    """us per primitive in each phase, from the slope between the two chain lengths."""
    short, long = lengths
    a, b = phases(kind, short, steps), phases(kind, long, steps)
    primitives = (long - short) * PER_LINK.get(kind, 1)
    return {p: 1e3 * (tb - ta) / primitives for p, ta, tb in zip(PHASES, a, b)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), metavar="KIND")
    p.add_argument("--lengths", type=int, nargs=2, default=[128, 256], metavar=("SHORT", "LONG"))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        p.error(f"argument --kinds: unknown {unknown}; kinds are {list(KINDS)}")
    short, long = args.lengths
    if not 0 < short < long:
        p.error(f"argument --lengths: need 0 < SHORT < LONG, got {short} {long}")
    check_at_least(p, "steps", [args.steps])
    print(f"{mx.default_device()}: us per primitive, chains of {short} and {long} links")
    print("| kind | build | encode | wait |")
    print("|---|---|---|---|")
    out = {}
    for kind in args.kinds:
        if not available(kind):
            print(f"| {kind} | - | - | - |  (CUDA only)")
            continue
        out[kind] = per_primitive(kind, (short, long), args.steps)
        print(f"| {kind} | " + " | ".join(f"{out[kind][p]:.2f}" for p in PHASES) + " |")
    return out


if __name__ == "__main__":
    main()
