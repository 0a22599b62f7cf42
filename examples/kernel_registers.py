"""Registers, shared memory and spills of kvfn's split decode kernels, compiled offline with
nvcc (no GPU needed) as MLX wraps an ``mx.fast.cuda_kernel`` body: the header, then a
``__global__`` template over the inputs and outputs. Registers bound the resident blocks an SM
holds (65536 / (threads x registers)), which ``kernels.BLOCKS_PER_SM`` (blocks of ``THREADS``)
and ``kernels.MMA_BLOCKS_PER_SM`` (the tensor-core kernel's, of ``MMA_THREADS``) assume.

    python examples/kernel_registers.py --unrolls 1 2 4     # D=128, 4 query heads a block
    python examples/kernel_registers.py --stages 0 2 3      # rows in registers or staged
    python examples/kernel_registers.py --kernels MMA_SPLIT_SOURCE --dims 64 128   # tensor cores
    python examples/kernel_registers.py --warps 4 8         # blocks of 128 or 256 threads
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.benchmark_kernels import load_kernels  # noqa: E402

KERNELS = {  # source name: (the kernel's inputs after q, its own template entries)
    "SPLIT_SOURCE": (["k", "v", "lengths"], ["HKV", "LSB", "LSH"]),
    "TWO_PART_SOURCE": (["k0", "v0", "k1", "v1", "lengths", "hmap"], ["H0", "H1", "HKV", "LSB"]),
    "SLOTS_SOURCE": (["k", "v", "lengths", "hmap"], ["HKV", "LSB"]),
    "MMA_SPLIT_SOURCE": (["k", "v", "lengths"], ["HKV", "LSB", "LSH"]),
}  # fmt: skip
MMA = ("MMA_SPLIT_SOURCE",)  # on MMA_HEADER (the others on HEADER), a template without U and P
INT_INPUTS = ("lengths", "hmap")
TEMPLATE = dict(HKV=8, LSB=0, LSH=0, H0=4, H1=4)  # sizes (capacities, splits) are read at run time


def resident_blocks(registers: int, threads: int = 128) -> int:
    """Blocks of ``threads`` an SM holds by registers (65536 an SM, allocated to a thread in
    multiples of 8)."""
    return 65536 // (threads * (-(-registers // 8) * 8))


def wrapped(kk, name: str, dim: int, unroll: int, stages: int = 0, dtype: str = "__nv_bfloat16",
            one_split: bool = False, threads: int = 128, heads: int = 4) -> str:  # fmt: skip
    """The kernel ``name`` as MLX wraps it, instantiated for ``dtype``, blocks of ``threads`` and
    ``heads`` query heads a block (the tensor-core kernel stages at least one step and takes no
    ``unroll``; ``one_split``: one split, whose output is the attention's, in ``dtype``)."""
    source = getattr(kk, name)
    header = kk.MMA_HEADER if name in MMA else kk.HEADER
    inputs, own = KERNELS[name]
    params = dict(W=threads // 32, D=dim, G=heads, GT=heads, NT=1,
                  **{k: TEMPLATE[k] for k in own})  # fmt: skip
    if name in MMA:
        params.update(ST=max(stages, 1))
    else:
        params.update(U=unroll, ST=stages, P=int(kk.PREFETCH))
    args = ["const T* q"]
    args += [f"const {'int' if n in INT_INPUTS else 'T'}* {n}" for n in inputs]
    args += ["const float* scale", "const int* dims", f"{'T' if one_split else 'float'}* o_part",
             "float* lse"]
    template = ", ".join(f"int {k}" for k in params)
    values = ", ".join(str(v) for v in params.values())
    types = ", ".join(a.rsplit(" ", 1)[0].replace("T*", f"{dtype}*") for a in args)
    return (
        f"#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n{header}\n"
        f"template <typename T, {template}>\n__global__ void split({', '.join(args)}) {{\n"
        f"{source}\n}}\n"
        f"template __global__ void split<{dtype}, {values}>({types});\n"
    )


def compiled(cu: str, arch: str = "sm_90") -> dict:
    """nvcc's resource report of a kernel source: registers, smem bytes, spill stores / loads
    (bytes). SystemExit with nvcc's output when it does not compile."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cu"
        path.write_text(cu)
        cmd = ["nvcc", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-c", str(path), "-o",
               str(Path(tmp) / "kernel.o")]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"nvcc failed:\n{done.stderr[-3000:]}")
    used = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    return dict(registers=int(used.group(1)), smem=int(used.group(2) or 0),
                spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))  # fmt: skip


def report(cu: str, arch: str, threads: int = 128) -> str:
    r = compiled(cu, arch)
    return (f"{r['registers']} registers ({resident_blocks(r['registers'], threads)} blocks of "
            f"{threads} threads an SM), {r['smem']} bytes smem, spills {r['spill_stores']} / "
            f"{r['spill_loads']} bytes")  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--dims", type=int, nargs="+", default=[128])
    p.add_argument("--unrolls", type=int, nargs="+", default=[2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=None,
                   help="steps staged through shared memory (default: kernels.STAGES)")  # fmt: skip
    p.add_argument("--warps", type=int, nargs="+", default=None,
                   help="warps a block (default: kernels.THREADS / 32, MMA_THREADS / 32 for "
                        "the tensor-core kernel)")  # fmt: skip
    p.add_argument("--arch", default="sm_90")
    args = p.parse_args(argv)
    if shutil.which("nvcc") is None:
        p.error("nvcc is not on the PATH (the CUDA toolkit compiles the kernels offline)")
    kk = load_kernels()
    for name in args.kernels:
        mma = name in MMA
        for dim in args.dims:
            for unroll in [None] if mma else args.unrolls:
                for st in args.stages or [kk.STAGES]:
                    for warps in args.warps or [(kk.MMA_THREADS if mma else kk.THREADS) // 32]:
                        cu = wrapped(kk, name, dim, unroll, st, threads=32 * warps)
                        shape = f"ST={max(st, 1)}" if mma else f"U={unroll} ST={st}"
                        print(f"{name} D={dim} {shape} W={warps}: "
                              f"{report(cu, args.arch, 32 * warps)}")  # fmt: skip


if __name__ == "__main__":
    main()
