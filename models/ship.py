"""Move a model to a machine that reaches no registry, in chunks of bounded size.

``convert`` gives a bf16 (or MLX-quantized) copy of a loaded model; ``save`` writes it as an
mlx-lm folder (safetensors, config.json, tokenizer.json, tokenizer_config.json with the chat
template) that mlx-lm and ``kvfn_models.load`` read with no GGUF and no download; ``chunk`` cuts
the folder's bytes into numbered chunk directories (c001, c002, ...) each at most ``limit``
bytes, every one holding the same manifest (files, pieces, sizes, sha256); ``join`` checks the
chunks against it and puts the folder back together.
"""

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import save_config, save_model

from .load import REQUANTIZE_BITS, _requantize

FORMAT = "kvfn-ship/1"
MANIFEST = "manifest.json"
DEFAULT_LIMIT = 56 << 20  # one device call carries 64 MiB, the working tree included
MANIFEST_ROOM = 64 << 10  # of each chunk's limit, kept for its copy of the manifest
BLOCK = 8 << 20


class ShipError(ValueError):
    """Chunks that are missing, corrupt or from another shipment."""


def _plain_weights(model: nn.Module) -> dict:
    """The model's parameters with every MLX-quantized layer dequantized to float32 (scales
    and biases too, as ``load_gguf`` dequantizes: no rounding through float16)."""
    weights = dict(tree_flatten(model.parameters()))
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            for name in ("weight", "scales", "biases"):
                weights.pop(f"{path}.{name}", None)
            scales, biases = m.scales.astype(mx.float32), m.biases.astype(mx.float32)
            weights[f"{path}.weight"] = mx.dequantize(
                m.weight, scales, biases, group_size=m.group_size, bits=m.bits, mode=m.mode
            )
    return weights


def convert(model: nn.Module, *, dtype=mx.bfloat16, bits: int | None = None) -> nn.Module:
    """A copy of the mlx-lm ``model`` (which is left as it is) with floating-point weights in
    ``dtype``; with ``bits``, its linear and embedding layers then MLX-quantized (affine, group
    size 64, as ``mlx_lm.convert`` does; a layer whose rows are not whole groups stays)."""
    if bits is not None and bits not in REQUANTIZE_BITS:
        raise ValueError(f"bits={bits} is not supported (choose from {REQUANTIZE_BITS})")
    if not mx.issubdtype(dtype, mx.floating):
        raise ValueError(f"dtype={dtype} is not a floating-point type")
    args = getattr(model, "args", None)
    if not dataclasses.is_dataclass(args):
        raise ValueError(f"{type(model).__name__} has no mlx-lm ModelArgs (.args) to rebuild it")
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in _plain_weights(model).items()
    }
    copy = type(model)(args)
    copy.load_weights(list(weights.items()), strict=True)
    if bits is not None:
        _requantize(copy, bits)
    mx.eval(copy.parameters())
    copy.eval()
    return copy


def _quantization(model: nn.Module) -> dict | None:
    """mlx-lm's config.json entry for a quantized model: its loader quantizes each layer that
    has scales, reading the layer's group size and bits from their shapes."""
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return {"group_size": m.group_size, "bits": m.bits, "mode": m.mode}
    return None


def _tokenizer_files(tokenizer, folder: Path) -> None:
    """tokenizer.json (the fast tokenizer's own) and a tokenizer_config.json that names the
    generic fast class, the special tokens and the chat template."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(hf).__name__} is not a fast tokenizer: no tokenizer.json to save")
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(getattr(hf, "add_bos_token", False)),
        "chat_template": getattr(hf, "chat_template", None),
    }
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(hf, name, None)
        if value is not None:
            config[name] = str(value)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def save(model: nn.Module, tokenizer, folder: str | Path) -> Path:
    """Write ``model`` and ``tokenizer`` as an mlx-lm model folder (created; it must not
    exist or be empty). The config's ``eos_token_id`` keeps every id that ends a turn."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty")
    args = getattr(model, "args", None)
    if not dataclasses.is_dataclass(args):
        raise ValueError(f"{type(model).__name__} has no mlx-lm ModelArgs (.args) to save")
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, model)
    config = dataclasses.asdict(args)
    eos = getattr(tokenizer, "eos_token_ids", None)
    if eos:
        config["eos_token_id"] = sorted(eos)
    quantization = _quantization(model)
    if quantization:
        config["quantization"] = quantization
    save_config(config, folder / "config.json")
    _tokenizer_files(tokenizer, folder)
    return folder


def _copy(src, dst, size: int, *hashes) -> int:
    """Copy up to ``size`` bytes from the open file ``src`` to ``dst``, feeding ``hashes``;
    returns the bytes copied (fewer at the end of ``src``)."""
    done = 0
    while done < size:
        block = src.read(min(BLOCK, size - done))
        if not block:
            break
        dst.write(block)
        for h in hashes:
            h.update(block)
        done += len(block)
    return done


def _plan(files: list[tuple[str, int]], room: int) -> list[list[dict]]:
    """Pieces of each file, in order, filling chunks of ``room`` bytes one after another."""
    chunks: list[list[dict]] = [[]]
    free = room
    for name, size in files:
        offset, k = 0, 0
        while True:
            if free == 0 and offset < size:
                chunks.append([])
                free = room
            take = min(free, size - offset)
            chunks[-1].append(dict(piece=f"{name}.{k:03d}", file=name, offset=offset, size=take))
            offset, free, k = offset + take, free - take, k + 1
            if offset == size:
                break
    return chunks


def chunk_name(i: int) -> str:
    return f"c{i + 1:03d}"


def chunk(folder: str | Path, out: str | Path, *, limit: int = DEFAULT_LIMIT) -> list[Path]:
    """Cut the files of ``folder`` into chunk directories ``out``/c001, c002, ... of at most
    ``limit`` bytes each (pieces and their copy of the manifest); returns them in order.
    ``out`` must not hold chunks already."""
    folder, out = Path(folder), Path(out)
    if limit <= 2 * MANIFEST_ROOM:
        raise ValueError(f"limit={limit} bytes is too small (more than {2 * MANIFEST_ROOM})")
    if not folder.is_dir():
        raise FileNotFoundError(f"no such model folder: {folder}")
    entries = sorted(folder.iterdir())
    nested = [p.name for p in entries if not p.is_file()]
    if nested:
        raise ValueError(f"{folder} holds something other than files: {', '.join(nested)}")
    if out.exists() and any(out.glob("c[0-9][0-9][0-9]")):
        raise FileExistsError(f"{out} already holds chunks")
    files = [(p.name, p.stat().st_size) for p in entries]
    plan = _plan(files, limit - MANIFEST_ROOM)
    dirs = [out / chunk_name(i) for i in range(len(plan))]
    whole = {name: hashlib.sha256() for name, _ in files}
    for d, pieces in zip(dirs, plan):
        d.mkdir(parents=True)
        for p in pieces:  # a file's pieces come in order, chunk after chunk
            h = hashlib.sha256()
            with open(folder / p["file"], "rb") as src, open(d / p["piece"], "wb") as dst:
                src.seek(p["offset"])
                if _copy(src, dst, p["size"], h, whole[p["file"]]) != p["size"]:
                    raise RuntimeError(f"{folder / p['file']} changed while it was cut")
            p["sha256"] = h.hexdigest()
    manifest = dict(
        format=FORMAT,
        name=folder.name,
        limit=limit,
        files=[dict(name=n, size=s, sha256=whole[n].hexdigest()) for n, s in files],
        chunks=[dict(dir=d.name, size=sum(p["size"] for p in ps), pieces=ps)
                for d, ps in zip(dirs, plan)],  # fmt: skip
    )
    text = json.dumps(manifest, indent=1)
    if len(text.encode()) > MANIFEST_ROOM:
        raise ValueError(f"the manifest of {len(plan)} chunks outgrows {MANIFEST_ROOM} bytes: "
                         f"raise the limit ({limit} bytes)")  # fmt: skip
    for d in dirs:
        (d / MANIFEST).write_text(text)
    return dirs


def read_manifest(stage: str | Path) -> dict:
    """The manifest that the chunk directories under ``stage`` share."""
    stage = Path(stage)
    found = sorted(stage.glob(f"c[0-9][0-9][0-9]/{MANIFEST}"))
    if not found:
        raise ShipError(f"no chunk (c001, c002, ... with a {MANIFEST}) under {stage}")
    text = found[0].read_text()
    for other in found[1:]:
        if other.read_text() != text:
            raise ShipError(f"chunk {other.parent.name}'s manifest differs from "
                            f"{found[0].parent.name}'s: it belongs to another shipment (keep one "
                            f"model's chunks in a folder) or is corrupt")  # fmt: skip
    manifest = json.loads(text)
    if manifest.get("format") != FORMAT:
        raise ShipError(f"{found[0]}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _missing(stage: Path, chunks: list[dict]) -> list[str]:
    missing = []
    for c in chunks:
        if not (stage / c["dir"]).is_dir():
            missing.append(c["dir"])
            continue
        gone = [p["piece"] for p in c["pieces"] if not (stage / c["dir"] / p["piece"]).is_file()]
        missing += [f"{c['dir']} (its {', '.join(gone)})"] if gone else []
    return missing


def join(stage: str | Path, folder: str | Path) -> Path:
    """Check the chunks under ``stage`` against their manifest and join them into the model
    folder ``folder`` (which must not exist or be empty); returns ``folder``. Every missing
    chunk, or the first corrupt one, is named, and nothing is left in ``folder``."""
    stage, folder = Path(stage), Path(folder)
    manifest = read_manifest(stage)
    chunks = manifest["chunks"]
    missing = _missing(stage, chunks)
    if missing:
        raise ShipError(f"{manifest['name']} comes in {len(chunks)} chunks; missing under "
                        f"{stage}: {', '.join(missing)}")  # fmt: skip
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty")
    pieces: dict[str, list] = {}  # file -> its (chunk, piece) in order
    for c in chunks:
        for p in c["pieces"]:
            pieces.setdefault(p["file"], []).append((c["dir"], p))
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in manifest["files"]:
            whole = hashlib.sha256()
            with open(tmp / f["name"], "wb") as dst:
                for c, p in pieces.get(f["name"], []):
                    path, h = stage / c / p["piece"], hashlib.sha256()
                    size = path.stat().st_size
                    if size == p["size"]:
                        with open(path, "rb") as src:
                            _copy(src, dst, size, h, whole)
                    if size != p["size"] or h.hexdigest() != p["sha256"]:
                        got = f"sha256 {h.hexdigest()}" if size == p["size"] else f"{size} bytes"
                        raise ShipError(
                            f"chunk {c} is corrupt: {p['piece']} has {got}; the manifest says "
                            f"{p['size']} bytes, sha256 {p['sha256']}. Copy that chunk again"
                        )
            if whole.hexdigest() != f["sha256"]:  # the pieces were right: a wrong manifest
                raise ShipError(f"{f['name']} joined into sha256 {whole.hexdigest()}; the "
                                f"manifest says {f['sha256']}")  # fmt: skip
        if folder.exists():
            folder.rmdir()
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
