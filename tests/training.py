"""Run the real training CLI in a subprocess and read its per-update JSON lines."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "metaseq" / "assets" / "qa_corpus.txt"


def run_train(save_dir: Path, *, world_size: int, max_update: int, extra: list[str] = (), check: bool = True,
              model_parallel_size: int = 1, fused_qkv: bool = False) -> subprocess.CompletedProcess:
    """`python -m metaseq.cli.train` with a global batch of 8 sequences of 48 tokens.

    `model_parallel_size` > 1 needs model sizes it divides (see `mp_harness.MP_MODEL_FLAGS`).
    """
    cmd = [
        sys.executable, "-m", "metaseq.cli.train",
        "--data", str(CORPUS), "--save-dir", str(save_dir),
        "--world-size", str(world_size), "--max-update", str(max_update),
        "--batch-size", "8", "--seq-len", "48", "--log-format", "json", *extra,
    ]
    if model_parallel_size != 1:
        cmd += ["--model-parallel-size", str(model_parallel_size)]
    if fused_qkv:
        cmd += ["--fused-qkv"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def losses(proc: subprocess.CompletedProcess) -> dict[int, float]:
    """num_updates -> loss, from the JSON lines rank 0 printed."""
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["num_updates"]: r["loss"] for r in records}
