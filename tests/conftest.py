import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from training import losses, run_train  # noqa: E402

TRAIN_UPDATES = 6


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
