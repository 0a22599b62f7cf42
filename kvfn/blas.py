"""Put OpenBLAS in front of the reference BLAS that the Linux mlx-cpu wheel bundles.

The wheel links the netlib reference BLAS (matmuls ~30-50x slower than OpenBLAS on x86-64).
Loading OpenBLAS with RTLD_GLOBAL before ``mlx.core`` is imported makes the dynamic linker
resolve ``sgemm_`` and friends to it. This module must not import mlx.
"""

import ctypes
import os
import sys
import warnings

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
ENV_VAR = "KVFN_OPENBLAS"

_loaded: str | None = None
_warned = False


def openblas_path() -> str | None:
    """The OpenBLAS library that would be loaded, or None (not Linux, none installed, disabled)."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV_VAR, "1") == "0":
        return None
    explicit = os.environ.get(ENV_VAR)
    if explicit and explicit != "1":
        if not os.path.exists(explicit):
            raise FileNotFoundError(f"{ENV_VAR}={explicit!r}: no such library")
        return explicit
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def use_openblas() -> str | None:
    """Load OpenBLAS globally if it helps and is possible; returns the path loaded or None.

    Set ``KVFN_OPENBLAS=0`` to keep the bundled BLAS, or to a path to pick a library.
    Too late once ``mlx.core`` is imported: then nothing is loaded and None is returned.
    """
    global _loaded, _warned
    if _loaded is not None:
        return _loaded
    path = openblas_path()
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        if not _warned and loaded_openblas() is None:
            _warned = True
            warnings.warn(
                "mlx.core was imported before kvfn, so MLX's CPU matmuls use the slow reference "
                f"BLAS (~30x slower): import kvfn first, or run with LD_PRELOAD={path}",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    return path


def loaded_openblas() -> str | None:
    """The OpenBLAS library mapped into this process (by kvfn, LD_PRELOAD or otherwise), if any."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line and "scipy_" not in line}
    except OSError:
        return _loaded
    return min(paths) if paths else None
