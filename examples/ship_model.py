"""Move a model to the GPU machine in chunks that each fit one device call, and join it there.

Here (converts, saves an mlx-lm folder, cuts it into .ship/NAME/c001, c002, ...; prints the
device calls to make):

    python examples/ship_model.py qwen2.5-coder-0.5b --bits 4

There, after the calls that each copied one chunk into $HOME/ship/NAME:

    python examples/ship_model.py --join $HOME/ship/NAME --out $HOME/models/NAME

then ``--model $HOME/models/NAME`` in any example (kvfn_models.load reads the folder).
"""

import argparse
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvfn  # noqa: E402,F401  (puts OpenBLAS in front before mlx loads)

try:
    import kvfn_models
except ImportError:  # a bare checkout (the GPU machine): the package is the folder models/
    spec = importlib.util.spec_from_file_location(
        "kvfn_models", ROOT / "models" / "__init__.py",
        submodule_search_locations=[str(ROOT / "models")],
    )  # fmt: skip
    kvfn_models = importlib.util.module_from_spec(spec)
    sys.modules["kvfn_models"] = kvfn_models
    spec.loader.exec_module(kvfn_models)

import mlx.core as mx  # noqa: E402
from kvfn_models import ship  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
CHECK_QUESTION = "What is the capital of France?"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", help="what kvfn_models.load takes: a model name "
                   "(qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), a .gguf file, an mlx-lm folder; "
                   "default: the embedded SmolLM2")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--bits", type=int, choices=ship.REQUANTIZE_BITS,
                   help="MLX-quantize linear and embedding layers (group size 64)")  # fmt: skip
    p.add_argument("--as-is", action="store_true",
                   help="ship the model's GGUF file unchanged (the published weights, no "
                   "conversion); there, --model FOLDER/FILE.gguf")  # fmt: skip
    p.add_argument("--limit-mib", type=float,
                   help="a chunk's size limit (default: a device call's 64 MiB less the working "
                   "tree that travels with it, less 1 MiB; 56 outside a git checkout)")  # fmt: skip
    p.add_argument("--out", help="chunks go to OUT/c001, ... (default: .ship/NAME); with --join "
                   "the model folder to write")  # fmt: skip
    p.add_argument("--keep-folder", action="store_true", help="keep OUT/model, the folder cut")
    p.add_argument("--join", metavar="STAGE", help="join the chunks under STAGE into --out")
    p.add_argument("--no-check", action="store_true",
                   help="with --join: do not load the folder and answer a question")  # fmt: skip
    args = p.parse_args(argv)
    if args.join and (args.model or not args.out):
        p.error("--join STAGE takes --out FOLDER and no model")
    if args.as_is and args.bits:
        p.error("--as-is ships the GGUF unchanged: it takes no --bits")
    if args.limit_mib is not None and args.limit_mib <= 0:
        p.error(f"argument --limit-mib: must be > 0, got {args.limit_mib}")
    return args


CALL_LIMIT = 64 << 20  # what one device call carries: the working tree and the carried chunk
MARGIN = 1 << 20
MIN_CHUNK = 8 << 20


def travelling_bytes(root: Path) -> int | None:
    """Bytes of the files a device call sends from the checkout at ``root``: tracked files and
    untracked ones git does not ignore (None outside a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=root, capture_output=True)  # fmt: skip
    except OSError:  # no git
        return None
    if listed.returncode != 0:
        return None
    paths = (root / name for name in listed.stdout.decode().split("\0") if name)
    return sum(p.stat().st_size for p in paths if p.is_file())


def default_limit(root: Path = ROOT) -> int:
    """A chunk's size limit: what a call carries besides the working tree at ``root``."""
    tree = travelling_bytes(root)
    if tree is None:
        return ship.DEFAULT_LIMIT
    limit = CALL_LIMIT - tree - MARGIN
    if limit < MIN_CHUNK:
        raise ValueError(f"the working tree at {root} sends {tree / 2**20:.1f} MiB with every "
                         f"device call: under {MIN_CHUNK >> 20} MiB is left for a chunk; ignore "
                         f"what the device does not need, or set --limit-mib")  # fmt: skip
    return limit


def default_name(args) -> str:
    """The model's name (a file's stem), with its dtype or bits: qwen2.5-coder-0.5b-4bit."""
    path = Path(args.model or "smollm2-135m")
    stem = path.stem if path.suffix == ".gguf" else path.name
    if args.as_is:
        return f"{stem}-gguf"
    return f"{stem}-{args.bits}bit" if args.bits else f"{stem}-{args.dtype}"


def ignore_in_git(path: Path) -> None:
    """Have git ignore a folder of chunks inside this checkout, as stage.sh does."""
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return
    run = dict(cwd=ROOT, capture_output=True, text=True)
    if subprocess.run(["git", "check-ignore", "-q", str(path)], **run).returncode == 0:
        return
    exclude = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], **run)
    if exclude.returncode == 0:
        top = "/" + path.resolve().relative_to(ROOT).parts[0] + "/"
        target = ROOT / exclude.stdout.strip()
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a") as f:
            f.write(top + "\n")
        print(f"added {top} to {target}")


def print_calls(dirs: list, name: str, model: str = "") -> None:
    """The device calls that carry one chunk each into $HOME/ship/NAME, and the join (then
    ``--model`` names the joined folder, or ``model``, a file in it: a GGUF shipped as is)."""
    try:
        rel = [d.resolve().relative_to(ROOT) for d in dirs]
    except ValueError:
        print(f"(carry takes paths inside {ROOT}: chunks elsewhere must be copied there first)")
        rel = dirs
    print("Make these device calls back to back (a machine stays warm 30 s), after stage.sh's:")
    for d in rel:
        print(f'  run(carry=["{d}"], command="mkdir -p $HOME/ship/{name} && cp -r {d} '
              f'$HOME/ship/{name}/")')  # fmt: skip
    print(f'  run(command="source $HOME/mlx-env.sh && python3 examples/ship_model.py --join '
          f'$HOME/ship/{name} --out $HOME/models/{name} && python3 examples/evaluate.py '
          f'--model $HOME/models/{name}{"/" + model if model else ""} ...")')  # fmt: skip


def gguf_folder(model: str | None, folder: Path) -> Path:
    """A folder holding (a link to) the model's GGUF file as it is."""
    path = kvfn_models.model_path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--as-is ships a GGUF file; {model!r} is not one")
    folder.mkdir(parents=True)
    try:
        (folder / path.name).hardlink_to(path)
    except OSError:
        shutil.copyfile(path, folder / path.name)
    return folder


def make_chunks(args) -> None:
    limit = int(args.limit_mib * 2**20) if args.limit_mib is not None else default_limit()
    name = default_name(args)
    out = Path(args.out or ROOT / ".ship" / name)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: {out} is not empty")
    ignore_in_git(out)
    t0 = time.perf_counter()
    if args.as_is:
        folder = gguf_folder(args.model, out / "model")
    else:
        model, tokenizer = kvfn_models.load(args.model)
        converted = ship.convert(model, dtype=getattr(mx, args.dtype), bits=args.bits)
        del model
        folder = ship.save(converted, tokenizer, out / "model")
    ggufs = [f.name for f in folder.glob("*.gguf")] if args.as_is else []
    dirs = ship.chunk(folder, out, limit=limit)
    total = sum(f.stat().st_size for f in folder.iterdir())
    if not args.keep_folder:
        shutil.rmtree(folder)
    sizes = [sum(f.stat().st_size for f in d.iterdir()) for d in dirs]
    print(f"{name}: {total / 2**20:.1f} MiB in {len(dirs)} chunks under {out} (largest "
          f"{max(sizes) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")  # fmt: skip
    tree = travelling_bytes(ROOT)
    if tree is not None:  # past that, every chunk call is refused
        room = (CALL_LIMIT - max(sizes)) / 2**20
        print(f"with them, a call has room for a working tree of {room:.1f} MiB; this one's is "
              f"{tree / 2**20:.1f} MiB")  # fmt: skip
    print_calls(dirs, name, ggufs[0] if ggufs else "")


def join(args) -> None:
    t0 = time.perf_counter()
    folder = ship.join(args.join, args.out)
    print(f"joined {folder} in {time.perf_counter() - t0:.1f} s")
    if args.no_check:
        return
    from mlx_lm import generate

    ggufs = sorted(folder.glob("*.gguf"))  # shipped --as-is
    model, tokenizer = kvfn_models.load(ggufs[0] if len(ggufs) == 1 else folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_QUESTION}],
                                           add_generation_prompt=True)  # fmt: skip
    print(f"{CHECK_QUESTION} {generate(model, tokenizer, prompt, max_tokens=12)!r} "
          f"({mx.default_device()})")  # fmt: skip


def main(argv=None) -> None:
    args = parse(argv)
    try:
        join(args) if args.join else make_chunks(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == "__main__":
    main()
