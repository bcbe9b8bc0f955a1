"""Parallel and distributed resharding: --num-workers, torchrun ranks, `{j}` model parts, progress output."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from metaseq.file_io import load_checkpoint
from metaseq.reshard import direct, locate, parallel, stream
from metaseq.reshard.distributed import World, detect_world, first_slurm_host
from metaseq.reshard.launch import expand_model_parts
from metaseq.reshard.locate import locate_tensors, map_located
from metaseq.reshard.parallel import OutputJob, default_num_workers, estimated_peak, held_bytes, memory_bound
from metaseq.reshard.progress import Progress, make_progress
from metaseq.reshard.ranges import resolve_path
from metaseq.reshard.schema import ReshardError
from metaseq.scripts.reshard_fsdp import main
from synthetic import assert_tree_equal, make_model, make_shards, write_shards

REPO = Path(__file__).resolve().parents[1]
SHARD = "checkpoint_last-model_part-{}-shard{}.pt"


@pytest.fixture
def parts_dir(tmp_path: Path) -> Path:
    """Model parts 0 and 1 (different weights), 4 training shards each, in tmp_path/ckpts."""
    for part in (0, 1):
        write_shards(make_shards(make_model(seed=part), 4), tmp_path / "ckpts", part=part)
    return tmp_path / "ckpts"


def _pattern(folder: Path, part: str = "0") -> str:
    return str(folder / SHARD.format(part, "*"))


def _load_folder(folder: Path) -> dict[str, dict]:
    return {p.name: load_checkpoint(p) for p in sorted(folder.iterdir())}


def _assert_same_files(actual: Path, expected: Path) -> None:
    got, want = _load_folder(actual), _load_folder(expected)
    assert sorted(got) == sorted(want)
    for name in want:
        assert_tree_equal(got[name], want[name], name)


def _error_line(err: str) -> str:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1, err
    return errors[0]


def _torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "metaseq.scripts.reshard_fsdp", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("io", [[], ["--torch-io"]], ids=["threads-copying", "torch-processes"])
def test_two_workers_write_the_same_files_as_one(parts_dir: Path, tmp_path: Path, io: list[str]) -> None:
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}" / "shard{i}.pt"
        assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "3",
                     "--num-workers", workers, "--quiet", *io]) == 0
    _assert_same_files(tmp_path / "w2", tmp_path / "w1")
    assert len(list((tmp_path / "w1").iterdir())) == 3


def test_model_parts_placeholder_reshards_every_part(parts_dir: Path, tmp_path: Path) -> None:
    pattern = str(parts_dir / SHARD.format("{j}", "*"))
    assert main(["--input", pattern, "--output", str(tmp_path / "all" / "part{j}-shard{i}.pt"),
                 "--num-output-shards", "2", "--num-workers", "2", "--quiet"]) == 0
    for part in ("0", "1"):
        out = tmp_path / "one" / f"part{part}-shard{{i}}.pt"
        assert main(["--input", _pattern(parts_dir, part), "--output", str(out), "--num-output-shards", "2",
                     "--quiet"]) == 0
    _assert_same_files(tmp_path / "all", tmp_path / "one")
    part1 = load_checkpoint(tmp_path / "all" / "part1-shard0.pt")["model"]["flat_param_0"]
    assert not torch.equal(part1, load_checkpoint(tmp_path / "all" / "part0-shard0.pt")["model"]["flat_param_0"])


def test_model_parts_are_found_on_disk_in_numeric_order(tmp_path: Path) -> None:
    for part in ("10", "2", "0"):
        (tmp_path / SHARD.format(part, 0)).write_bytes(b"")
    (tmp_path / SHARD.format("x", 0)).write_bytes(b"")  # not a part number: ignored
    pairs = expand_model_parts(str(tmp_path / SHARD.format("{j}", "*")), "out/part{j}.pt")
    assert [out for _, out in pairs] == ["out/part0.pt", "out/part2.pt", "out/part10.pt"]
    assert pairs[2][0] == str(tmp_path / SHARD.format("10", "*"))


@pytest.mark.parametrize("inp, out, flag", [("a-{j}-shard*.pt", "o.pt", "--input-glob-pattern has '{j}'"),
                                            ("a-shard*.pt", "o-{j}.pt", "--output-shard-name has '{j}'")])
def test_model_part_placeholder_must_be_in_both_names(inp: str, out: str, flag: str) -> None:
    with pytest.raises(ReshardError, match=flag):
        expand_model_parts(inp, out)


@pytest.mark.parametrize("io", [[], ["--torch-io"]], ids=["threads-copying", "torch-processes"])
def test_worker_error_is_one_line_and_leaves_no_output(parts_dir: Path, tmp_path: Path, capsys, io) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "1").write_text("a file where output 1's folder should be")
    argv = ["--input", _pattern(parts_dir), "--output", str(out / "{i}" / "shard.pt"), "--num-output-shards", "3",
            "--num-workers", "2", *io]
    assert main(argv) == 2
    assert f"{out / '1' / 'shard.pt'}: cannot write" in _error_line(capsys.readouterr().err)
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["1"]  # outputs 0 and 2 removed, no temp files


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(parts_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "shard{i}.pt"
    assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("INFO: wrote")]
    assert len(lines) == 2
    assert "[1/2 files, " in lines[0] and "MB/s, ETA" in lines[0] and "[2/2 files, 100%" in lines[1]
    assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "2",
                 "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def _record(results: list, value: Any) -> Any:
    results.append(value)
    return value


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_with_rate_on_a_terminal() -> None:
    stream = _Terminal()
    progress = make_progress(2_000_000, 2, quiet=False, stream=stream)
    assert progress.mode == "bar"
    progress.advance(0, 600_000)
    progress.finish(0, 1_000_000, "a.pt", 10)
    progress.advance(0, 5)  # a late report of a finished output counts no more
    progress.finish(1, 1_000_000, "b.pt", 10)
    progress.close()
    assert progress.done == 2_000_000
    assert "2.00M/2.00M" in stream.getvalue() and "B/s" in stream.getvalue()
    assert make_progress(1, 1, quiet=True, stream=_Terminal()).mode == "off"


def test_inputs_are_unpickled_once_and_opened_about_once(tmp_path: Path, monkeypatch) -> None:
    write_shards(make_shards(make_model(), 16), tmp_path / "many")
    write_shards(make_shards(make_model(), 1), tmp_path / "one")
    unpickled: list[str] = []
    mapped: list[str] = []
    real_load, real_map = parallel.load_checkpoint, locate.map_located
    monkeypatch.setattr(parallel, "load_checkpoint", lambda path, **kw: unpickled.append(path) or real_load(path, **kw))
    monkeypatch.setattr(locate, "map_located", lambda located: mapped.append(located.path) or real_map(located))

    def run(inputs: Path, num_outputs: int) -> tuple[int, int]:
        unpickled.clear()
        mapped.clear()
        out = tmp_path / f"{inputs.name}-{num_outputs}" / "s{i}.pt"
        assert main(["--input", _pattern(inputs), "--output", str(out), "--num-output-shards", str(num_outputs),
                     "--num-workers", "1", "--quiet", "--torch-io"]) == 0
        return len(unpickled), len(mapped)

    # Writing unpickles rank 0 only (its other keys are carried); the planner located every other tensor.
    assert run(tmp_path / "one", 32) == (1, 0)  # 1 -> 32: the input stays open for every output
    assert run(tmp_path / "many", 1) == (1, 13)  # 16 -> 1: inputs 1..13 hold data (14, 15: padding only)
    assert len(set(mapped)) == len(mapped)
    _, opened = run(tmp_path / "many", 5)
    assert opened <= 16 + 2 * 5  # linear in N + M, where reopening per output would be N x M = 80


def test_direct_inputs_are_read_once_while_planning_and_never_while_writing(tmp_path: Path, monkeypatch) -> None:
    write_shards(make_shards(make_model(), 16), tmp_path / "many")
    read: list[str] = []
    real_read = direct.read_structure
    monkeypatch.setattr(direct, "read_structure", lambda path: read.append(path) or real_read(path))
    monkeypatch.setattr(parallel, "load_checkpoint", lambda *a, **kw: pytest.fail("torch.load while writing"))
    out = tmp_path / "out" / "s{i}.pt"
    assert main(["--input", _pattern(tmp_path / "many"), "--output", str(out), "--num-output-shards", "5",
                 "--quiet"]) == 0
    assert sorted(read) == sorted(str(p) for p in (tmp_path / "many").iterdir())
    assert len(list((tmp_path / "out").iterdir())) == 5


def _fake_plan(flat_numel: int) -> types.SimpleNamespace:
    model = types.SimpleNamespace(flat_params=[types.SimpleNamespace(numel=flat_numel)], dtypes=[torch.float32])
    options = types.SimpleNamespace(unflatten=False)
    return types.SimpleNamespace(options=options, source=types.SimpleNamespace(model=model), trust_checkpoint=False,
                                 direct=())


@pytest.mark.parametrize("flat_mib, output_mib, num_jobs, cpus, checksums, expected", [
    (1, 1, 16, 8, False, 1),  # small model: a second process alone costs more than the bound's slack
    (4096, 32, 1024, 8, False, 8),  # a 4 GiB flat parameter leaves room for 8 workers of 32 MiB outputs
    (4096, 32, 1024, 3, False, 3),  # ... but no more than the CPUs
    (4096, 32, 96, 8, False, 1),  # ... and 3 GiB of outputs do not pay for starting workers
    (4096, 1024, 16, 8, True, 4),  # in memory: 320 + 4 x (160 + 1024) MiB <= 1024 + 4096 + 256 MiB
    (1, 1024, 16, 8, True, 1),  # a 1 GiB output built in memory: one process only
    (1, 1024, 16, 8, False, 4),  # ... but streamed, a writer holds 64 MiB: 320 + 4 x 224 <= 1024 + 1 + 256
])
def test_default_workers_stay_within_the_memory_bound(flat_mib, output_mib, num_jobs, cpus, checksums, expected):
    plans = [_fake_plan(flat_mib * 2**20 // 4)]
    jobs = [OutputJob(i, 0, i, f"o{i}.pt", output_mib * 2**20) for i in range(num_jobs)]
    workers = default_num_workers(plans, jobs, cpus=cpus, checksums=checksums)
    assert workers == expected
    assert estimated_peak(workers, held_bytes(plans, jobs, checksums)) <= memory_bound(plans, jobs)


def test_progress_totals_count_each_output_once() -> None:
    progress = Progress(30, 3, mode="off")
    for job in range(3):
        progress.advance(job, 4)
        progress.finish(job, 10, f"{job}.pt", 10)
    assert (progress.done, progress.files) == (30, 3)


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"RANK": "0", "WORLD_SIZE": "1"}, None),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, World(3, 8, 4, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "0"}, World(5, 16, 1, "slurm")),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}, None),  # the batch script itself, not an srun step
])
def test_launcher_world_is_read_from_the_environment(env: dict[str, str], expected: World | None) -> None:
    assert detect_world(env) == expected


@pytest.mark.parametrize("nodelist, host", [("node7", "node7"), ("gpu[003-004,010],cpu1", "gpu003"),
                                            ("a1,b2", "a1"), ("rack[2-3]-n[08-09]", "rack2-n08")])
def test_first_slurm_host_expands_the_host_list(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


def test_torchrun_ranks_write_the_same_files_as_one_process(parts_dir: Path, tmp_path: Path) -> None:
    pattern = str(parts_dir / SHARD.format("{j}", "*"))
    proc = _torchrun(["--input", pattern, "--output", str(tmp_path / "ranks" / "part{j}-shard{i}.pt"),
                      "--num-output-shards", "3"])
    assert proc.returncode == 0, proc.stderr
    assert "2 ranks wrote 6 file(s)" in proc.stderr
    assert main(["--input", pattern, "--output", str(tmp_path / "single" / "part{j}-shard{i}.pt"),
                 "--num-output-shards", "3", "--num-workers", "1", "--quiet"]) == 0
    _assert_same_files(tmp_path / "ranks", tmp_path / "single")


def test_torchrun_failure_on_one_rank_fails_every_rank_and_removes_outputs(parts_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "1").write_text("blocks output 1, which rank 1 writes")
    proc = _torchrun(["--input", _pattern(parts_dir), "--output", str(out / "{i}" / "shard.pt"),
                      "--num-output-shards", "2"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
    # Both ranks report it, unless torchrun stops one (SIGTERM) as soon as the other has exited.
    assert any(f"rank 1 of 2: {out / '1' / 'shard.pt'}: cannot write" in e for e in errors), proc.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["1"]  # rank 0's output removed


def test_located_tensors_map_to_the_same_values_as_loading(tmp_path: Path) -> None:
    path = write_shards(make_shards(make_model(), 3), tmp_path)[1]
    loaded = load_checkpoint(path, mmap=True)
    located = locate_tensors(loaded, str(path))
    assert located is not None and ("model", "decoder.layers.0.flat_param_0") in located.tensors
    mapped = map_located(located)
    for key in located.tensors:
        assert_tree_equal(resolve_path(mapped, key), resolve_path(loaded, key), str(key))


def test_unlocatable_files_fall_back_and_changed_files_are_refused(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save(make_shards(make_model(), 1)[0], legacy, _use_new_zipfile_serialization=False)
    assert locate_tensors(load_checkpoint(legacy, mmap=True), str(legacy)) is None  # not a zip: load instead
    path = write_shards(make_shards(make_model(), 2), tmp_path / "zip")[1]
    located = locate_tensors(load_checkpoint(path, mmap=True), str(path))
    os.utime(path, ns=(located.mtime_ns + 10**9, located.mtime_ns + 10**9))
    with pytest.raises(ReshardError, match="changed while resharding"):
        map_located(located)


@pytest.mark.parametrize("flags", [
    ["--num-output-shards", "3"],
    ["--num-output-shards", "1", "--unflatten-weights"],  # tied parameters, consolidated optimizer state
    ["--num-output-shards", "2", "--output-dtype", "bf16", "--drop-metaseq-req"],  # cast through the buffer
    ["--num-output-shards", "5", "--skip-optimizer-state"],
])
def test_streamed_outputs_equal_outputs_built_in_memory(parts_dir, tmp_path, monkeypatch, flags) -> None:
    shards = make_shards(make_model(), 4)
    shards[0]["extra_state"]["rng"] = torch.arange(6, dtype=torch.int64)  # a carried tensor
    write_shards(shards, tmp_path / "in")
    argv = ["--input", _pattern(tmp_path / "in"), "--num-workers", "1", "--quiet", *flags]
    assert main([*argv, "--torch-io", "--output", str(tmp_path / "memory" / "s{i}.pt")]) == 0
    assert main([*argv, "--output", str(tmp_path / "direct" / "s{i}.pt")]) == 0  # without torch where it can
    sizes: list[int | None] = []
    real_stream = stream.stream_output_shard
    monkeypatch.setattr(parallel, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "stream_output_shard", lambda *a, **kw: _record(sizes, real_stream(*a, **kw)))
    assert main([*argv, "--torch-io", "--output", str(tmp_path / "streamed" / "s{i}.pt")]) == 0
    assert len(sizes) == len(list((tmp_path / "memory").iterdir())) and None not in sizes  # all streamed
    _assert_same_files(tmp_path / "streamed", tmp_path / "memory")
    _assert_same_files(tmp_path / "direct", tmp_path / "memory")
    if "--unflatten-weights" in flags:
        model = load_checkpoint(tmp_path / "streamed" / "s0.pt")["model"]
        assert model["decoder.output_projection.weight"] is model["decoder.embed_tokens.weight"]


def test_unstreamable_structure_falls_back_to_building_in_memory(tmp_path: Path, monkeypatch) -> None:
    shards = make_shards(make_model(), 2)
    shards[0]["extra_state"]["custom"] = types.SimpleNamespace(t=torch.ones(3))  # a tensor inside an object
    write_shards(shards, tmp_path / "in")
    sizes: list[int | None] = []
    real_stream = stream.stream_output_shard
    monkeypatch.setattr(parallel, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(stream, "stream_output_shard", lambda *a, **kw: _record(sizes, real_stream(*a, **kw)))
    out = tmp_path / "out" / "s{i}.pt"
    assert main(["--input", _pattern(tmp_path / "in"), "--output", str(out), "--num-output-shards", "2",
                 "--trust-checkpoint", "--quiet"]) == 0
    assert sizes == [None, None]  # tried, could not locate the tensor inside the object
    got = load_checkpoint(tmp_path / "out" / "s1.pt", trust=True)
    assert torch.equal(got["extra_state"]["custom"].t, torch.ones(3))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s0.pt", "s1.pt"]  # no temp file left


def test_sigterm_while_writing_removes_outputs_and_reports_one_line(parts_dir, tmp_path, monkeypatch, capsys) -> None:
    real_write = parallel.write_direct_output
    saved: list[str] = []

    def write_then_terminated(source, options, rank, inputs, path, **kwargs):
        size = real_write(source, options, rank, inputs, path, **kwargs)
        saved.append(str(path))
        if len(saved) == 2:  # e.g. torchrun stopping this rank because another one failed
            os.kill(os.getpid(), signal.SIGTERM)
        return size

    monkeypatch.setattr(parallel, "write_direct_output", write_then_terminated)
    handler_before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out" / "s{i}.pt"
    assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "4",
                 "--num-workers", "1"]) == 2
    assert "terminated by SIGTERM" in _error_line(capsys.readouterr().err)
    assert len(saved) == 2 and not any(os.path.exists(p) for p in saved)  # the second: renamed, then the signal
    assert signal.getsignal(signal.SIGTERM) is handler_before  # main() put the previous handler back


def test_many_inputs_need_few_open_files(tmp_path: Path) -> None:
    """A 175B checkpoint has ~1000 shards per part; the writer opens one input at a time (limit here: 48 files)."""
    write_shards(make_shards(make_model(), 100), tmp_path / "in")
    out = tmp_path / "out" / "s{i}.pt"
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))\n"
        "from metaseq.scripts.reshard_fsdp import main\n"
        f"sys.exit(main(['--input', {_pattern(tmp_path / 'in')!r}, '--output', {str(out)!r},"
        " '--num-output-shards', '2', '--quiet']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    want = main(["--input", _pattern(tmp_path / "in"), "--output", str(tmp_path / "ref" / "s{i}.pt"),
                 "--num-output-shards", "2", "--quiet", "--torch-io"])
    assert want == 0
    _assert_same_files(tmp_path / "out", tmp_path / "ref")
