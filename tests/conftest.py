import json
import os
import signal
import sys
from pathlib import Path

import pytest
from filelock import FileLock

if "PYTEST_XDIST_WORKER" in os.environ:  # two workers on two cores: one thread each, subprocesses too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mp_harness import run_train_mp  # noqa: E402
from training import losses, run_train  # noqa: E402

TRAIN_UPDATES = 6
MP_UPDATES = 4


def shared_run(tmp_path_factory, name, train):
    """`train(save_dir) -> {update: loss}` once per test session, even under pytest-xdist.

    xdist's workers share the parent of their temp folders: the first worker to get here
    trains under a file lock, the others wait and read its folder and losses.
    """
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    save_dir, record = root / f"shared_{name}", root / f"shared_{name}.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            save_dir.mkdir(exist_ok=True)
            record.write_text(json.dumps(train(save_dir)))
    return save_dir, {int(k): v for k, v in json.loads(record.read_text()).items()}


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Real FSDP runs at W = 1, 2, 4: {W: (save_dir, {update: loss})}.

    Each saves after update 4 (`checkpoint_4-*`) and at the end (`checkpoint_last-*`).
    """
    return {w: shared_run(tmp_path_factory, f"train_w{w}", lambda save_dir, w=w: losses(run_train(
        save_dir, world_size=w, max_update=TRAIN_UPDATES, extra=["--save-interval-updates", "4"]))) for w in (1, 2, 4)}


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
    return {name: shared_run(tmp_path_factory, name, lambda save_dir, spec=spec: losses(
        run_train_mp(save_dir, max_update=MP_UPDATES, **spec))) for name, spec in specs.items()}


if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job's (`make test &`): the tests of Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # send it to this process, as a terminal would
