import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mp_harness import run_train_mp  # noqa: E402
from training import losses, run_train  # noqa: E402

TRAIN_UPDATES = 6
MP_UPDATES = 4


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Real FSDP runs at W = 1, 2, 4: {W: (save_dir, {update: loss})}.

    Each saves after update 4 (`checkpoint_4-*`) and at the end (`checkpoint_last-*`).
    """
    runs = {}
    for w in (1, 2, 4):
        save_dir = tmp_path_factory.mktemp(f"train_w{w}")
        proc = run_train(save_dir, world_size=w, max_update=TRAIN_UPDATES, extra=["--save-interval-updates", "4"])
        runs[w] = (save_dir, losses(proc))
    return runs


@pytest.fixture(scope="session")
def mp_runs(tmp_path_factory):
    """{name: (save_dir, {update: loss})} for P = 2 and P = 1, both attention layouts, same seed and batches.

    "p2" and "p2_fused" run 2 parts x 2 shards (W = 4); "p2" and "p1" also save after update 2 (`checkpoint_2-*`).
    """
    specs = {
        "p2": dict(model_parallel_size=2, world_size=4, extra=["--save-interval-updates", "2"]),
        "p1": dict(model_parallel_size=1, world_size=1, extra=["--save-interval-updates", "2"]),
        "p2_fused": dict(model_parallel_size=2, world_size=4, fused_qkv=True),
        "p1_fused": dict(model_parallel_size=1, world_size=1, fused_qkv=True),
    }
    out = {}
    for name, spec in specs.items():
        save_dir = tmp_path_factory.mktemp(name)
        out[name] = (save_dir, losses(run_train_mp(save_dir, max_update=MP_UPDATES, **spec)))
    return out
