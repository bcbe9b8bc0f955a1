"""Run reshard scenarios against the baselines on synthetic checkpoints and judge the targets.

For each input shard count N named in the scenarios: synthesize an N-shard
checkpoint of the requested size, time the two baselines on it (`cp` + `sync`;
`torch.load` + `torch.save` of every shard), then run each N -> M scenario as a
subprocess of `python -m metaseq.scripts.reshard_fsdp` with optimizer state.
Every contender starts with `sync` done and the inputs in the page cache (they
were just written or read); with `drop_caches` the cache is emptied instead, so
every contender reads from disk. Outputs are deleted after each run. With
`repeats` > 1 every contender runs that many times: the fastest time and the
highest memory count.

Targets (docs/performance.md):
- memory, flat N -> M: peak anonymous RSS <= largest output shard + largest flat
  parameter + 256 MiB; unflattened N -> 1: <= output size + 256 MiB;
- speed, flat scenarios with at most `MANY_FILES` shards on each side:
  <= 1.3x load+save and <= 2x cp+sync; with more shards (per-file overhead),
  wall time <= `per_file_limit_s`. Unflattened scenarios have no speed target.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metaseq.benchmark import synth
from metaseq.benchmark.measure import Measurement, best_of, drop_page_cache, run_measured
from metaseq.models.transformer_lm import ModelConfig

__all__ = [
    "BenchConfig",
    "Baselines",
    "Scenario",
    "ScenarioResult",
    "SweepPoint",
    "format_table",
    "judge_targets",
    "measure_baselines",
    "memory_bound",
    "parse_scenarios",
    "plan_inputs",
    "reshard_command",
    "run_benchmark",
    "run_scenario",
    "run_size_sweep",
    "timed_run",
]

logger = logging.getLogger(__name__)

GB = 10**9  # sizes and speeds are decimal GB; memory is shown in MiB
MIB = 2**20
SLACK_BYTES = 256 * MIB
LOAD_SAVE_FACTOR = 1.3
COPY_FACTOR = 2.0
MANY_FILES = 64
PER_FILE_LIMIT_S = 10.0
_SCENARIO_RE = re.compile(r"(?:(\d+)x)?(\d+)-(?:(\d+)x)?(\d+)(u?)((?:\+(?:fp16|bf16|verify))*)")


@dataclass(frozen=True)
class Scenario:
    inputs: int  # N
    outputs: int  # M
    unflatten: bool = False  # "8-1u": --unflatten-weights True
    extras: tuple[str, ...] = ()  # "8-16+fp16+verify": --output-dtype fp16 --verify
    in_parts: int = 1  # "2x4-1x8": model parts P x shards N -> Q x M (reshard_model_parallel)
    out_parts: int | None = None

    @property
    def name(self) -> str:
        if self.out_parts is None:
            base = f"{self.inputs}-{self.outputs}"
        else:
            base = f"{self.in_parts}x{self.inputs}-{self.out_parts}x{self.outputs}"
        return base + ("u" if self.unflatten else "") + "".join(f"+{e}" for e in self.extras)

    @property
    def flags(self) -> list[str]:
        """The reshard flags of the extras."""
        flags = [] if "verify" not in self.extras else ["--verify"]
        return flags + [f for e in self.extras if e != "verify" for f in ("--output-dtype", e)]

    @property
    def many_files(self) -> bool:
        return max(self.inputs, self.outputs) > MANY_FILES


def parse_scenarios(text: str) -> list[Scenario]:
    """`"8-1,8-16,8-1u"` -> scenarios; raises ValueError naming --scenarios."""
    scenarios = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        match = _SCENARIO_RE.fullmatch(item)
        numbers = [int(g) for g in match.groups()[:4] if g is not None] if match else [0]
        if not match or min(numbers) < 1 or (match[1] is None) != (match[3] is None):
            raise ValueError(f"--scenarios {text!r}: {item!r} is not N-M, N-1u or PxN-QxM (model parts x shards) "
                             "with numbers >= 1, optionally followed by +fp16, +bf16 or +verify (e.g. 8-16, 2x4-1x8)")
        extras = tuple(e for e in match[6].split("+") if e)
        mp = match[1] is not None
        scenario = Scenario(int(match[2]), int(match[4]), match[5] == "u", extras, int(match[1] or 1),
                            int(match[3]) if mp else None)
        if scenario.unflatten and scenario.outputs != 1:
            raise ValueError(
                f"--scenarios {text!r}: {item!r}: an unflattened output is one file per part; use "
                f"{dataclasses.replace(scenario, outputs=1).name}"
            )
        scenarios.append(scenario)
    if not scenarios:
        raise ValueError(f"--scenarios {text!r} names no scenario; e.g. --scenarios 8-1,8-16")
    return scenarios


@dataclass(frozen=True)
class BenchConfig:
    size_gb: float  # total bytes of all input shard files (model + optimizer state), in GB
    scenarios: list[Scenario]
    workdir: Path
    layers: int = 12
    drop_caches: bool = False
    repeats: int = 1  # runs per contender: best time, worst memory
    keep_inputs: bool = False  # leave the synthetic checkpoints in workdir
    per_file_limit_s: float = PER_FILE_LIMIT_S
    timeout_s: float | None = None  # per contender run
    real_structured: bool = False  # inputs structured like upstream metaseq's OPT shards (synth's docstring)


@dataclass(frozen=True)
class Baselines:
    inputs: int  # shards per model part
    input_bytes: int
    load_save: Measurement
    copy: Measurement
    parts: int = 1


@dataclass
class ScenarioResult:
    scenario: str
    inputs: int
    outputs: int
    unflatten: bool
    input_bytes: int
    output_bytes: int
    seconds: float
    gb_per_s: float
    ratio_load_save: float
    ratio_copy: float
    peak_rss: int
    peak_anon: int
    memory_bound: int
    returncode: int
    targets: dict[str, bool | None] = field(default_factory=dict)  # None: no such target here
    runs_seconds: tuple[float, ...] = ()  # every repetition; `seconds` is the fastest
    stderr_tail: str = ""

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and all(v is not False for v in self.targets.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def memory_bound(config: ModelConfig, scenario: Scenario) -> int:
    """Allowed peak anonymous RSS in bytes, from the synthesized structure (optimizer state kept).

    Flat: largest output shard (every output shard holds the same tensor bytes)
    + largest flat parameter + 256 MiB. Unflattened: the output file (each
    parameter once, plus its two Adam moments) + 256 MiB.
    """
    numels = [layout.numel for layout in synth.flat_layouts(config)]
    floats = len(synth.STATE_KINDS)  # param, exp_avg, exp_avg_sq
    if scenario.unflatten:
        return floats * sum(numels) * synth.FLOAT_BYTES + SLACK_BYTES
    files = scenario.outputs * (scenario.out_parts or 1)  # model parts: as if the files were one part's shards
    shard = floats * sum(synth.shard_numel(n, files) for n in numels) * synth.FLOAT_BYTES
    return shard + max(numels) * synth.FLOAT_BYTES + SLACK_BYTES


def reshard_command(scenario: Scenario, input_glob: str, out_dir: Path) -> list[str]:
    """The reshard CLI call for one scenario; optimizer state is always kept."""
    cmd = [
        sys.executable, "-m", "metaseq.scripts.reshard_fsdp",
        "--input-glob-pattern", input_glob,
        "--output-shard-name", str(out_dir / "out-shard{i}.pt"),
        "--num-output-shards", str(scenario.outputs),
        "--quiet",
    ]
    if scenario.out_parts is not None:
        cmd[2] = "metaseq.scripts.reshard_model_parallel"
        cmd[6] = str(out_dir / "out-model_part-{j}-shard{i}.pt")
        cmd += ["--num-output-parts", str(scenario.out_parts)]
    return cmd + (["--unflatten-weights", "True"] if scenario.unflatten else []) + scenario.flags


def timed_run(cmd: list[str], out_dir: Path, config: BenchConfig) -> tuple[Measurement, int]:
    """Run one contender `config.repeats` times, each into an empty `out_dir`.

    Returns the combined measurement (`best_of`) and the output bytes. Dirty
    pages are written back before each run (or the page cache dropped with
    `drop_caches`), so no contender pays for another's writes.
    """
    runs, out_bytes = [], 0
    for _ in range(config.repeats):
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        if config.drop_caches:
            drop_page_cache()
        else:
            os.sync()
        m = run_measured(cmd, timeout=config.timeout_s)
        out_bytes = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
        shutil.rmtree(out_dir)
        runs.append(m)
        if m.returncode != 0:
            logger.error("exit %d after %.1f s: %s\n%s", m.returncode, m.seconds, " ".join(cmd), m.stderr_tail)
            break
    return best_of(runs), out_bytes


def measure_baselines(ckpt: synth.SyntheticCheckpoint, config: BenchConfig) -> Baselines:
    """cp + sync of the shard files, and torch.load + torch.save of each; both must succeed."""
    out = config.workdir / "baseline-out"
    paths = [str(p) for p in ckpt.paths]
    # `sync FILES` fsyncs just the copies, as the other contenders fsync their outputs;
    # a bare `sync` would also wait for unrelated writers on the machine.
    copy_script = 'out=$1; shift; cp -- "$@" "$out" && sync -- "$out"/*'
    copy, _ = timed_run(["sh", "-c", copy_script, "sh", str(out), *paths], out, config)
    load_save, _ = timed_run(
        [sys.executable, "-m", "metaseq.scripts.benchmark_baseline", "load-save",
         "--input-glob-pattern", ckpt.glob_pattern, "--output-dir", str(out), *_baseline_flags(config)],
        out, config,
    )
    for name, m in (("cp+sync", copy), ("load+save", load_save)):
        if m.returncode != 0:
            raise RuntimeError(f"baseline {name} failed (exit {m.returncode}) on {ckpt.glob_pattern}: {m.stderr_tail}")
    return Baselines(ckpt.world_size, ckpt.total_bytes, load_save, copy, ckpt.parts)


def _baseline_flags(config: BenchConfig) -> list[str]:
    """Real-structured inputs hold an upstream class: the baselines load them as upstream's loader does."""
    return ["--real-structured"] if config.real_structured else []


def run_scenario(
    scenario: Scenario, ckpt: synth.SyntheticCheckpoint, baselines: Baselines, config: BenchConfig
) -> ScenarioResult:
    out = config.workdir / f"out-{scenario.name}"
    m, out_bytes = timed_run(reshard_command(scenario, ckpt.glob_pattern, out), out, config)
    bound = memory_bound(ckpt.config, scenario)
    return ScenarioResult(
        scenario=scenario.name,
        inputs=scenario.inputs,
        outputs=scenario.outputs,
        unflatten=scenario.unflatten,
        input_bytes=baselines.input_bytes,
        output_bytes=out_bytes,
        seconds=m.seconds,
        gb_per_s=baselines.input_bytes / GB / m.seconds,
        ratio_load_save=m.seconds / baselines.load_save.seconds,
        ratio_copy=m.seconds / baselines.copy.seconds,
        peak_rss=m.peak_rss,
        peak_anon=m.peak_anon,
        memory_bound=bound,
        returncode=m.returncode,
        targets=judge_targets(scenario, m, bound, baselines, config.per_file_limit_s),
        runs_seconds=m.runs_seconds,
        stderr_tail=m.stderr_tail if m.returncode else "",
    )


def judge_targets(
    scenario: Scenario, m: Measurement, bound: int, baselines: Baselines, per_file_limit_s: float
) -> dict[str, bool | None]:
    """Pass/fail per target; None where the target does not apply. A failed run fails all."""
    ok = m.returncode == 0
    targets: dict[str, bool | None] = {"memory": ok and m.peak_anon <= bound,
                                       "vs_load_save": None, "vs_copy": None, "seconds": None}
    if scenario.unflatten or "verify" in scenario.extras:  # --verify reads everything twice more
        return targets
    if scenario.many_files:
        targets["seconds"] = ok and m.seconds <= per_file_limit_s
    else:
        targets["vs_load_save"] = ok and m.seconds <= LOAD_SAVE_FACTOR * baselines.load_save.seconds
        targets["vs_copy"] = ok and m.seconds <= COPY_FACTOR * baselines.copy.seconds
    return targets


def plan_inputs(config: BenchConfig) -> dict[tuple[int, int], ModelConfig]:
    """Model config per (input parts, shards per part), checked before anything is written."""
    size = int(config.size_gb * GB)
    model_parallel = any(s.out_parts for s in config.scenarios)  # sizes that 2 and 4 parts divide
    return {(p, n): synth.plan_model_config(size, p * n, layers=config.layers, real_structured=config.real_structured,
                                            parts=4 if model_parallel else 1)
            for p, n in dict.fromkeys((s.in_parts, s.inputs) for s in config.scenarios)}


def run_benchmark(config: BenchConfig) -> tuple[list[Baselines], list[ScenarioResult]]:
    """All scenarios, grouped by input shard count; each group's inputs are deleted when done."""
    baselines, results = [], []
    for (parts, n), model_config in plan_inputs(config).items():
        in_dir = config.workdir / f"in-{parts}x{n}"
        logger.info("writing %d x %d synthetic shard(s), embed dim %d, %d layers, to %s",
                    parts, n, model_config.decoder_embed_dim, model_config.decoder_layers, in_dir)
        ckpt = synth.write_synthetic_checkpoint(in_dir, model_config, parts * n, real_structured=config.real_structured)
        if parts > 1:
            ckpt = _cut_into_parts(ckpt, parts, n, in_dir)
        base = measure_baselines(ckpt, config)
        baselines.append(base)
        for scenario in (s for s in config.scenarios if (s.in_parts, s.inputs) == (parts, n)):
            logger.info("running %s", scenario.name)
            results.append(run_scenario(scenario, ckpt, base, config))
            logger.info("%s: %.2f s, peak anon %.0f MiB (bound %.0f MiB)", scenario.name, results[-1].seconds,
                        results[-1].peak_anon / MIB, results[-1].memory_bound / MIB)
        if not config.keep_inputs:
            shutil.rmtree(in_dir)
    return baselines, results


def _cut_into_parts(ckpt: synth.SyntheticCheckpoint, parts: int, n: int, in_dir: Path) -> synth.SyntheticCheckpoint:
    """A model-parallel input: the one-part synthetic checkpoint cut into `parts` x `n` by the tool (untimed)."""
    out = in_dir / "parts"
    cmd = [sys.executable, "-m", "metaseq.scripts.reshard_model_parallel", "--input-glob-pattern", ckpt.glob_pattern,
           "--output-shard-name", str(out / "checkpoint_last-model_part-{j}-shard{i}.pt"),
           "--num-output-parts", str(parts), "--num-output-shards", str(n), "--overwrite", "--quiet"]  # a kept --workdir
    subprocess.run(cmd, check=True)
    for path in ckpt.paths:
        path.unlink()
    paths = tuple(out / synth.shard_file_name("checkpoint_last", j, i) for j in range(parts) for i in range(n))
    return dataclasses.replace(ckpt, world_size=n, paths=paths, parts=parts)


def format_table(baselines: list[Baselines], results: list[ScenarioResult]) -> str:
    """A Markdown table: baselines first, then one row per scenario."""
    header = ["run", "input GB", "seconds", "GB/s", "x load+save", "x cp", "peak RSS MiB",
              "peak anon MiB", "bound MiB", "memory", "speed"]
    rows = []
    for b in baselines:
        for name, m in (("cp+sync", b.copy), ("load+save", b.load_save)):
            rows.append([f"{name} ({b.parts}x{b.inputs} in)" if b.parts > 1 else f"{name} ({b.inputs} in)", f"{b.input_bytes / GB:.3f}", f"{m.seconds:.2f}",
                         f"{b.input_bytes / GB / m.seconds:.3f}", "", "", f"{m.peak_rss / MIB:.0f}",
                         f"{m.peak_anon / MIB:.0f}", "", "", ""])
    for r in results:
        if r.returncode != 0:  # nothing measured: its error is in the log
            rows.append([r.scenario, f"{r.input_bytes / GB:.3f}", f"failed (exit {r.returncode})", *[""] * 7, "FAIL"])
            continue
        rows.append([r.scenario, f"{r.input_bytes / GB:.3f}", f"{r.seconds:.2f}", f"{r.gb_per_s:.3f}",
                     f"{r.ratio_load_save:.2f}", f"{r.ratio_copy:.2f}", f"{r.peak_rss / MIB:.0f}",
                     f"{r.peak_anon / MIB:.0f}", f"{r.memory_bound / MIB:.0f}",
                     _verdict([r.targets["memory"]]), _speed_verdict(r)])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _verdict(flags: list[bool | None]) -> str:
    flags = [f for f in flags if f is not None]
    if not flags:
        return "n/a"
    return "pass" if all(flags) else "FAIL"


def _speed_verdict(r: ScenarioResult) -> str:
    names = {"vs_load_save": f"<= {LOAD_SAVE_FACTOR}x load+save", "vs_copy": f"<= {COPY_FACTOR:g}x cp",
             "seconds": "within the time limit"}
    failed = [names[k] for k in names if r.targets[k] is False]
    return f"FAIL ({', '.join(failed)})" if failed else _verdict([r.targets[k] for k in names])


@dataclass(frozen=True)
class SweepPoint:
    size_gb: float
    input_bytes: int
    memory_bound: int
    tool: Measurement
    reference: Measurement  # the load-everything approach


SWEEP_SCENARIO = Scenario(8, 1)


def run_size_sweep(sizes_gb: list[float], config: BenchConfig) -> list[SweepPoint]:
    """Flat 8 -> 1 with optimizer state at each size, by this tool and by load-everything."""
    points = []
    for size in sizes_gb:
        model_config = synth.plan_model_config(int(size * GB), SWEEP_SCENARIO.inputs, layers=config.layers,
                                               real_structured=config.real_structured)
        in_dir, out = config.workdir / f"sweep-in-{size:g}", config.workdir / "sweep-out"
        ckpt = synth.write_synthetic_checkpoint(in_dir, model_config, SWEEP_SCENARIO.inputs,
                                                real_structured=config.real_structured)
        tool, _ = timed_run(reshard_command(SWEEP_SCENARIO, ckpt.glob_pattern, out), out, config)
        reference, _ = timed_run(
            [sys.executable, "-m", "metaseq.scripts.benchmark_baseline", "load-everything",
             "--input-glob-pattern", ckpt.glob_pattern, "--output", str(out / "out-shard0.pt"),
             *_baseline_flags(config)],
            out, config,
        )
        points.append(SweepPoint(size, ckpt.total_bytes, memory_bound(model_config, SWEEP_SCENARIO), tool, reference))
        logger.info("%g GB: tool %.1f s / %.0f MiB anon, load-everything %.1f s / %.0f MiB anon", size,
                    tool.seconds, tool.peak_anon / MIB, reference.seconds, reference.peak_anon / MIB)
        if not config.keep_inputs:
            shutil.rmtree(in_dir)
    return points
