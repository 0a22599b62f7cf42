"""How the examples start a memory measurement, so that nothing before it is counted in it.

MLX's ``reset_peak_memory`` sets the peak to 0 and the next allocation counts what is live. An
array held only by a reference cycle stays live until Python's collector runs; freed in the
middle of a measurement, it would be in the peak of that measurement's first part alone. So
every start collects garbage first.
"""

import gc

import mlx.core as mx


def reset_peak() -> None:
    """Garbage collected, then MLX's peak reset."""
    gc.collect()
    mx.reset_peak_memory()


def peak_gib() -> float:
    """MLX's peak memory since the last ``reset_peak()``, in GiB."""
    return round(mx.get_peak_memory() / 2**30, 3)


def cleared() -> None:
    """Garbage collected and MLX's buffer cache emptied once the device is idle: what follows
    starts as after a fresh load, whatever ran before it."""
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def baseline() -> int:
    """``cleared()``, the peak reset, and the active bytes it starts from (the weights and
    anything made beforehand): a measurement's own peak is ``mx.get_peak_memory()`` minus it."""
    cleared()
    mx.reset_peak_memory()
    return mx.get_active_memory()
