"""Time and peak memory vs checkpoint size, as a PNG. Needs the `bench` extra (matplotlib)."""
from __future__ import annotations

import os

from metaseq.benchmark.runner import GB, SWEEP_SCENARIO, SweepPoint

__all__ = ["plot_sweep"]

GIB = 2**30


def plot_sweep(points: list[SweepPoint], path: str | os.PathLike) -> None:
    """Two panels over input size: wall seconds, and peak anonymous RSS with the tool's bound."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    sizes = [p.input_bytes / GB for p in points]
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    ax_time.plot(sizes, [p.tool.seconds for p in points], "o-", label="reshard_fsdp")
    ax_time.plot(sizes, [p.reference.seconds for p in points], "s--", label="load everything")
    ax_time.set(xlabel="checkpoint size (GB, all input shards)", ylabel="wall time (s)", title="time")
    ax_mem.plot(sizes, [p.tool.peak_anon / GIB for p in points], "o-", label="reshard_fsdp")
    ax_mem.plot(sizes, [p.reference.peak_anon / GIB for p in points], "s--", label="load everything")
    ax_mem.plot(sizes, [p.memory_bound / GIB for p in points], ":", color="gray", label="target bound")
    ax_mem.set(xlabel="checkpoint size (GB, all input shards)", ylabel="peak anonymous RSS (GiB)",
               title="memory")
    for ax in (ax_time, ax_mem):
        ax.grid(alpha=0.3)
        ax.legend()
    scenario = f"{SWEEP_SCENARIO.inputs} -> {SWEEP_SCENARIO.outputs} flat shards with Adam state"
    fig.suptitle(f"Resharding {scenario}")
    fig.savefig(path, dpi=100)
    plt.close(fig)
