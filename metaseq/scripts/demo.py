"""The whole story in one command (`make demo`): train with FSDP, reshard, serve, resume.

    python -m metaseq.scripts.demo [--out-dir demo_out]

1. trains the small LM on metaseq/assets/qa_corpus.txt with 4 FSDP ranks on CPU,
   in rounds, until greedy decoding reproduces every corpus line;
2. reshards the 4 shards into 1 unflattened file without optimizer state;
3. asks the interactive CLI "what is the meaning of life?" (answer: "To be happy.");
4. reshards a checkpoint 4 -> 8 -> 4 with optimizer state and checks that every
   tensor comes back bit for bit;
5. resumes training from the 4 -> 8 -> 4 shards and compares the losses with the
   uninterrupted run.

Every step runs the real CLIs in subprocesses (`python -m metaseq.cli.train`,
`python -m metaseq.scripts.reshard_fsdp`, `python -m metaseq.cli.interactive_cli`);
their logs go to OUT/logs/. A smaller budget for quick checks: `--updates 100 --round-updates 25`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from metaseq.cli_start import run_as_main
from metaseq.data import load_lines
from metaseq.file_io import load_checkpoint, shard_file_name, shard_glob
from metaseq.hub_utils import GenerationConfig, GeneratorInterface

logger = logging.getLogger("metaseq.scripts.demo")

CORPUS = Path(__file__).resolve().parents[1] / "assets" / "qa_corpus.txt"
MARKER = ".metaseq-demo"  # marks a folder this demo made, so a rerun may clear it
SUBDIRS = ("train", "reshard_1", "reshard_8", "reshard_8_4", "resumed", "logs")
WORLD_SIZE, WIDE_WORLD_SIZE = 4, 8
LOSS_TOLERANCE = 1e-6


class DemoError(RuntimeError):
    """A step failed; the message says which and where its log is."""


@dataclass
class DemoConfig:
    out_dir: Path = Path("demo_out")
    updates: int = 150  # first training round
    round_updates: int = 50  # each further round, while the corpus is not reproduced
    max_update: int = 400  # no round goes past this
    question: str = "what is the meaning of life?"
    expected: str = "To be happy."
    # Measured on 2 cores: this default-size model (2 layers, dim 30) reproduces all
    # 16 corpus lines after 100-150 full-corpus updates at lr 1e-2, for seeds 1-5.
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 1e-2
    seed: int = 1

    def validate(self) -> None:
        if self.updates < 3 or self.round_updates < 3:
            raise ValueError(f"--updates={self.updates} and --round-updates={self.round_updates} must be at least 3")
        if self.max_update < self.updates:
            raise ValueError(f"--max-update={self.max_update} is below --updates={self.updates}")
        if self.batch_size % WIDE_WORLD_SIZE:
            raise ValueError(f"--batch-size={self.batch_size} must be divisible by {WIDE_WORLD_SIZE}")


def build_parser() -> argparse.ArgumentParser:
    d = DemoConfig
    p = argparse.ArgumentParser(
        prog="python -m metaseq.scripts.demo",
        description="Train with 4 FSDP ranks on CPU, reshard 4 -> 1 and 4 -> 8 -> 4, serve and resume.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out-dir", type=Path, default=d.out_dir, help="everything the demo writes goes here")
    p.add_argument("--updates", type=int, default=d.updates, help="updates of the first training round")
    p.add_argument("--round-updates", type=int, default=d.round_updates, help="updates of each further round")
    p.add_argument("--max-update", type=int, default=d.max_update, help="stop adding rounds here")
    p.add_argument("--question", default=d.question, help="asked through the interactive CLI in step 3")
    p.add_argument("--expected", default=d.expected, help="the answer the CLI must print")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global sequences per update (divisible by 8)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=d.seed, help="model init and data order")
    return p


def prepare_out_dir(out_dir: Path) -> None:
    """Create `out_dir`; clear the demo's own subfolders from an earlier run, never foreign files."""
    try:
        if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
            raise ValueError(f"--out-dir {out_dir} exists, is not empty and was not made by this demo; pick another")
        for name in SUBDIRS:
            shutil.rmtree(out_dir / name, ignore_errors=True)
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        (out_dir / MARKER).touch()
    except OSError as e:  # a file on the way, no permission
        raise ValueError(f"--out-dir {out_dir}: cannot make it a folder ({e.strerror or e}); pick another") from None


def rel(path: Path | str) -> str:
    """A short path for display: relative to the current folder when it is below it."""
    text = os.path.relpath(path)
    return str(path) if text.startswith("..") else text


def python_m(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def show(cmd: list[str], stdin: str | None = None) -> None:
    text = shlex.join(["python", *cmd[1:]])
    logger.info("  $ %s%s", f"echo {shlex.quote(stdin)} | " if stdin else "", text)


def run_logged(cmd: list[str], log: Path, *, stdin: str | None = None) -> str:
    """Run `cmd`, stderr to `log`; return stdout. DemoError (with the log's tail) on failure."""
    show(cmd, stdin)
    with open(log, "w") as err:
        proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=err, text=True, env=subprocess_env())
    if proc.returncode != 0:
        raise DemoError(f"step failed (exit {proc.returncode}): {_tail(log)} (full log: {rel(log)})")
    return proc.stdout


def subprocess_env() -> dict[str, str]:
    # One thread per process: 4 ranks share 2 cores; more threads only contend.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def train_command(cfg: DemoConfig, save_dir: Path, end: int, restore: Path | None, save_at: int) -> list[str]:
    args = [
        "--data", rel(CORPUS), "--save-dir", rel(save_dir), "--world-size", str(WORLD_SIZE),
        "--max-update", str(end), "--save-interval-updates", str(save_at),
        "--batch-size", str(cfg.batch_size), "--seq-len", str(cfg.seq_len),
        "--lr", str(cfg.lr), "--seed", str(cfg.seed), "--log-format", "json",
    ]
    if restore is not None:
        args += ["--restore-file", rel(restore)]
    return python_m("metaseq.cli.train", *args)


def train(cfg: DemoConfig, save_dir: Path, start: int, end: int, *, restore: Path | None, save_at: int,
          log: Path) -> dict[int, float]:
    """Updates start+1..end, saving at `save_at` (0: none) and `end`. Returns {update: loss}.

    Progress: a bar on a terminal, else a line every 25 updates.
    """
    cmd = train_command(cfg, save_dir, end, restore, save_at)
    show(cmd)
    bar_mode = sys.stdout.isatty()
    losses: dict[int, float] = {}
    with open(log, "w") as err, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=subprocess_env()
    ) as proc, tqdm(total=end, initial=start, desc="  train", unit="update", disable=not bar_mode,
                   file=sys.stdout, leave=False) as bar:
        for line in proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                n = record["num_updates"]
                losses[n] = record["loss"]
                bar.update(1)
                bar.set_postfix(loss=f"{losses[n]:.4f}")
                if not bar_mode and (n % 25 == 0 or n == end):
                    logger.info("  update %4d/%d  loss %.4f", n, end, losses[n])
    if proc.returncode != 0 or end not in losses:
        raise DemoError(f"training failed (exit {proc.returncode}): {_tail(log)} (full log: {rel(log)})")
    if bar_mode:
        logger.info("  update %4d/%d  loss %.4f", end, end, losses[end])
    return losses


def corpus_pairs(lines: list[str]) -> list[tuple[str, str]]:
    """(prompt, expected completion) per line: the prompt ends at the first '?' (else after half the words)."""
    pairs = []
    for line in lines:
        if "?" in line:
            cut = line.index("?") + 1
            pairs.append((line[:cut], line[cut:].strip()))
        else:
            words = line.split()
            half = max(1, len(words) // 2)
            pairs.append((" ".join(words[:half]), " ".join(words[half:])))
    return pairs


def find_unreproduced(path: Path, pairs: list[tuple[str, str]]) -> list[str]:
    """The corpus lines that greedy decoding of the checkpoint at `path` gets wrong."""
    gen = GeneratorInterface.from_checkpoint(str(path))
    answers = gen.generate([p for p, _ in pairs], GenerationConfig(max_new_tokens=64))
    return [f"{p} {a}" for (p, a), got in zip(pairs, answers) if got.strip() != a]


def train_until_reproduced(cfg: DemoConfig, train_dir: Path, logs: Path) -> tuple[int, dict[int, float], bool]:
    """Train in rounds until the corpus is reproduced or `max_update`; (updates, last round's losses, ok)."""
    pairs = corpus_pairs(load_lines(CORPUS))
    start, end, restore, round_no = 0, cfg.updates, None, 1
    while True:
        # Also save 2 updates before the end: step 5 resumes there and replays the last 2.
        losses = train(cfg, train_dir, start, end, restore=restore, save_at=end - 2,
                       log=logs / f"train_round{round_no}.log")
        wrong = find_unreproduced(train_dir / "checkpoint_last.pt", pairs)
        logger.info("  greedy decoding reproduces %d/%d corpus lines after %d updates", len(pairs) - len(wrong), len(pairs), end)
        if not wrong or end + cfg.round_updates > cfg.max_update:
            if wrong:
                logger.warning("  still wrong after %d updates (--max-update): %s", end, "; ".join(wrong[:3]))
            return end, losses, not wrong
        logger.info("  not yet: training %d more updates", cfg.round_updates)
        start, end, restore, round_no = end, end + cfg.round_updates, train_dir / "checkpoint_last.pt", round_no + 1


def reshard(inputs: str, output: Path, num: int, *, unflatten: bool, skip_optimizer: bool, log: Path) -> None:
    args = ["--input-glob-pattern", inputs, "--output-shard-name", rel(output), "--num-output-shards", str(num)]
    args += ["--skip-optimizer-state", "True"] if skip_optimizer else []
    args += ["--unflatten-weights", "True"] if unflatten else []
    run_logged(python_m("metaseq.scripts.reshard_fsdp", *args), log)


def ask(path: Path, question: str, log: Path) -> str:
    out = run_logged(python_m("metaseq.cli.interactive_cli", "--path", rel(path)), log, stdin=question)
    return out.strip()


def tensor_mismatches(a: object, b: object, where: str = "") -> list[str]:
    """Paths at which two checkpoint trees differ in a tensor (bit for bit) or in structure."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} (keys differ)"]
        return [m for k in a for m in tensor_mismatches(a[k], b[k], f"{where}/{k}")]
    return []


def compare_shard_sets(original: Path, prefix_a: str, roundtrip: Path, prefix_b: str) -> list[str]:
    """Model and optimizer tensors of W shards that differ between two folders."""
    bad = []
    for rank in range(WORLD_SIZE):
        a = load_checkpoint(original / shard_file_name(prefix_a, 0, rank))
        b = load_checkpoint(roundtrip / shard_file_name(prefix_b, 0, rank))
        for key in ("model", "last_optimizer_state"):
            bad += [f"shard{rank}: {key}{m}" for m in tensor_mismatches(a[key], b[key])]
    return bad


def step_train(cfg: DemoConfig, out: Path) -> tuple[int, dict[int, float], bool]:
    logger.info("[1/5] train: %d FSDP ranks on CPU (gloo) on %s until greedy decoding reproduces it",
                WORLD_SIZE, rel(CORPUS))
    result = train_until_reproduced(cfg, out / "train", out / "logs")
    logger.info("  each checkpoint is %d shard files: %s", WORLD_SIZE,
                shard_glob(rel(out / "train" / "checkpoint_last.pt")))
    return result


def step_consolidate_and_ask(cfg: DemoConfig, out: Path) -> bool:
    logger.info("[2/5] reshard %d -> 1: unflattened weights, no optimizer state", WORLD_SIZE)
    served = out / "reshard_1" / "reshard-model_part-0.pt"
    reshard(shard_glob(rel(out / "train" / "checkpoint_last.pt")), served, 1, unflatten=True, skip_optimizer=True,
            log=out / "logs" / "reshard_1.log")
    logger.info("  wrote %s (%d bytes)", rel(served), served.stat().st_size)
    logger.info("[3/5] ask the interactive CLI (a plain model, no FSDP)")
    answer = ask(served, cfg.question, out / "logs" / "interactive_cli.log")
    logger.info("  > %s", cfg.question)
    logger.info("  %s", answer)
    if answer != cfg.expected:
        logger.error("  expected %r, got %r", cfg.expected, answer)
    return answer == cfg.expected


def step_roundtrip(out: Path, checkpoint: str) -> bool:
    logger.info("[4/5] reshard %s %d -> %d -> %d with optimizer state", checkpoint, WORLD_SIZE, WIDE_WORLD_SIZE, WORLD_SIZE)
    logs = out / "logs"
    reshard(shard_glob(rel(out / "train" / f"{checkpoint}.pt")),
            out / "reshard_8" / "checkpoint_last-model_part-0-shard{i}.pt", WIDE_WORLD_SIZE,
            unflatten=False, skip_optimizer=False, log=logs / "reshard_8.log")
    reshard(shard_glob(rel(out / "reshard_8" / "checkpoint_last.pt")),
            out / "reshard_8_4" / "checkpoint_last-model_part-0-shard{i}.pt", WORLD_SIZE,
            unflatten=False, skip_optimizer=False, log=logs / "reshard_8_4.log")
    bad = compare_shard_sets(out / "train", checkpoint, out / "reshard_8_4", "checkpoint_last")
    if bad:
        logger.error("  %d tensors changed in the round trip: %s", len(bad), ", ".join(bad[:4]))
    else:
        logger.info("  every flat parameter and Adam moment of the %d shards is back bit for bit", WORLD_SIZE)
    return not bad


def step_resume(cfg: DemoConfig, out: Path, end: int, uninterrupted: dict[int, float]) -> bool:
    logger.info("[5/5] resume from the %d -> %d -> %d shards: updates %d-%d", WORLD_SIZE, WIDE_WORLD_SIZE, WORLD_SIZE, end - 1, end)
    resumed = train(cfg, out / "resumed", end - 2, end, restore=out / "reshard_8_4" / "checkpoint_last.pt", save_at=0,
                    log=out / "logs" / "train_resumed.log")
    ok = True
    for n in (end - 1, end):
        same = abs(resumed[n] - uninterrupted[n]) <= LOSS_TOLERANCE
        ok &= same
        logger.info("  update %d: loss %r resumed, %r uninterrupted: %s", n, resumed[n], uninterrupted[n],
                    "equal" if same else "DIFFERENT")
    return ok


def run_demo(cfg: DemoConfig) -> bool:
    out = cfg.out_dir
    prepare_out_dir(out)
    end, losses, reproduced = step_train(cfg, out)
    answered = step_consolidate_and_ask(cfg, out)
    roundtrip = step_roundtrip(out, f"checkpoint_{end - 2}")
    resumed = step_resume(cfg, out, end, losses)
    return reproduced and answered and roundtrip and resumed


def configure_output() -> list[logging.Handler]:
    """The demo's narrative goes to stdout and its errors to stderr, message only."""
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return [out, err]


def main(argv: list[str] | None = None) -> int:
    cfg = DemoConfig(**vars(build_parser().parse_args(argv)))
    handlers = configure_output()
    t0 = time.perf_counter()
    try:
        cfg.validate()
        ok = run_demo(cfg)
        verdict = "done" if ok else "FAILED (see above)"
        logger.info("%s in %.0fs; everything is under %s/", verdict, time.perf_counter() - t0, rel(cfg.out_dir))
        return 0 if ok else 1
    except ValueError as e:
        logger.error("error: %s", e)
        return 2
    except DemoError as e:
        logger.error("error: %s", e)
        return 1
    except KeyboardInterrupt:
        logger.error("interrupted; what the demo wrote so far is under %s/", rel(cfg.out_dir))
        return 130
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.propagate = True


if __name__ == "__main__":
    run_as_main(main)
