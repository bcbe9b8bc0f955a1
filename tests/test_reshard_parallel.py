"""Parallel and distributed resharding: --num-workers, torchrun ranks, `{j}` model parts, progress output."""
from __future__ import annotations

import argparse
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from metaseq import torchzip
from metaseq.errors import ReshardError
from metaseq.file_io import load_checkpoint
from metaseq.reshard import ReshardOptions, plan_reshard, reshard_shards
from metaseq.reshard import distributed
from metaseq.reshard.distributed import World, detect_world, first_slurm_host, slurm_rendezvous
from metaseq.reshard.plan import expand_model_parts
from metaseq.reshard.progress import Progress, make_progress
from metaseq.reshard.write import list_jobs, write_outputs
from metaseq.scripts.reshard_fsdp import main
from metaseq.scripts.reshard_model_parallel import main as reshard_model_parallel
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


def test_two_workers_write_the_same_files_as_one(parts_dir: Path, tmp_path: Path) -> None:
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}" / "shard{i}.pt"
        assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "3",
                     "--num-workers", workers, "--quiet"]) == 0
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


def test_worker_error_is_one_line_and_leaves_no_output(parts_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "1").symlink_to("/proc")  # output 1's folder: a folder where no file can be made, even by root
    argv = ["--input", _pattern(parts_dir), "--output", str(out / "{i}" / "shard.pt"), "--num-output-shards", "3",
            "--num-workers", "2"]
    assert main(argv) == 2
    assert f"{out / '1' / 'shard.pt'}: cannot write" in _error_line(capsys.readouterr().err)
    assert [p.name for p in out.rglob("*") if p.is_symlink() or p.is_file()] == ["1"]  # 0 and 2 removed, no temps


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(parts_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "shard{i}.pt"
    assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("INFO: wrote")]
    assert len(lines) == 2
    assert "[1/2 files, " in lines[0] and "MB/s, ETA" in lines[0] and "[2/2 files, 100%" in lines[1]
    assert main(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "2",
                 "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


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


BIG = (("", (("decoder.embed_tokens.weight", (40, 16)),), (("decoder.embed_tokens.weight", "decoder.output_projection.weight"),)),
       ("decoder.layers.0", (("fc1.weight", (48, 16)),), ()))  # storages above 64 bytes: read while writing


def test_writing_reads_inputs_by_copying_bytes_never_by_unpickling(tmp_path: Path, monkeypatch) -> None:
    """Pickles are read once, while planning; writing opens an input once per output that needs it."""
    write_shards(make_shards(make_model(instances=BIG), 16), tmp_path / "many")
    inputs = {str(p) for p in (tmp_path / "many").iterdir()}
    plans = plan_reshard(ReshardOptions(input_glob_pattern=_pattern(tmp_path / "many"),
                                        output_shard_name=str(tmp_path / "out" / "s{i}.pt"), num_output_shards=5))
    opened: list[str] = []
    real_open, real_os_open = open, os.open

    def no_reading(path: Any, *args: Any, **kwargs: Any) -> Any:
        assert str(path) not in inputs, f"{path} read again while writing"
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_reading)
    monkeypatch.setattr(os, "open", lambda path, *a, **kw: opened.append(str(path)) or real_os_open(path, *a, **kw))
    assert len(write_outputs(list_jobs(plans))) == 5
    needed = sum(len({run.input for t in out.tensors for run in t.runs}) for out in plans[0].outputs)
    assert 16 <= len([p for p in opened if p in inputs]) <= needed <= 16 + 2 * 5  # not N x M = 80


def test_inputs_changed_after_planning_are_refused(tmp_path: Path) -> None:
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    options = ReshardOptions(input_glob_pattern=_pattern(tmp_path / "in"), output_shard_name=str(tmp_path / "o.pt"))
    plans = plan_reshard(options)
    path = plans[0].inputs[1].path
    os.utime(path, ns=(plans[0].inputs[1].mtime_ns + 10**9,) * 2)
    with pytest.raises(ReshardError, match=f"{path} changed while resharding"):
        write_outputs(list_jobs(plans))
    assert not (tmp_path / "o.pt").exists()


def test_an_input_changed_while_the_last_output_is_written_is_refused(tmp_path: Path) -> None:
    """Checked after the copy too: a change during the only output's write leaves no output."""
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    options = ReshardOptions(input_glob_pattern=_pattern(tmp_path / "in"), output_shard_name=str(tmp_path / "o.pt"))
    plans = plan_reshard(options)
    changed = plans[0].inputs[1]

    class Touching(Progress):  # the writer reports bytes as it copies: change an input then
        def advance(self, job: int, nbytes: int) -> None:
            os.utime(changed.path, ns=(changed.mtime_ns + 10**9,) * 2)

    with pytest.raises(ReshardError, match=f"{changed.path} changed while resharding"):
        write_outputs(list_jobs(plans), progress=Touching(plans[0].outputs[0].nbytes, 1, mode="off"))
    assert not (tmp_path / "o.pt").exists() and [p.name for p in tmp_path.iterdir()] == ["in"]


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


@pytest.mark.parametrize("env, words", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2 (0 to 1)"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 is not a rank of WORLD_SIZE=2 (0 to 1)"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
     "SLURM_PROCID=4 is not a rank of SLURM_NTASKS=4"),
])
def test_a_launcher_environment_that_names_no_rank_is_refused(env: dict[str, str], words: str) -> None:
    with pytest.raises(ReshardError, match=re.escape(words)):
        detect_world(env)


def test_srun_steps_of_one_job_meet_at_their_own_port() -> None:
    step = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-004]", "SLURM_STEP_ID": "0"}
    first, second = slurm_rendezvous(step), slurm_rendezvous({**step, "SLURM_STEP_ID": "1"})
    assert first["MASTER_ADDR"] == second["MASTER_ADDR"] == "gpu003" and first["MASTER_PORT"] != second["MASTER_PORT"]
    assert 20000 <= int(first["MASTER_PORT"]) < 40000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, cwd: Path, port: int, argv: list[str], node: int | None = None) -> subprocess.Popen:
    """Rank `rank` of 2 in `cwd`; `node`: torchrun's GROUP_RANK, the node it would run on (else: this host)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(REPO), **({} if node is None else {"GROUP_RANK": str(node)})}
    return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("given, words", [({}, "MASTER_ADDR and MASTER_PORT not set; export MASTER_ADDR (rank 0's "
                                                "host name) and MASTER_PORT (a free port), or launch with torchrun"),
                                           ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT not set; export MASTER_PORT (a "
                                                                          "free port), or launch with torchrun")])
def test_a_rank_without_the_rendezvous_address_says_what_to_export(tmp_path: Path, given: dict, words: str) -> None:
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    argv = [sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input",
            str(tmp_path / "in" / SHARD.format(0, "*")), "--output", str(tmp_path / "out" / "s{i}.pt"), "--quiet"]
    proc = subprocess.run(argv, cwd=REPO, env={**env, "RANK": "0", "WORLD_SIZE": "2", **given}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and _error_line(proc.stderr) == f"ERROR: torchrun rank 0 of 2: {words}"
    assert not (tmp_path / "out").exists()


def test_a_rendezvous_port_another_program_holds_is_named(tmp_path: Path) -> None:
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    argv = ["-m", "metaseq.scripts.reshard_fsdp", "--input", str(tmp_path / "in" / SHARD.format(0, "*")), "--output",
            str(tmp_path / "out" / "s{i}.pt"), "--quiet"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rank = _rank(0, REPO, port, argv)
        code, err = rank.wait(timeout=120), rank.stderr.read()
    assert code == 2 and _error_line(err).startswith(f"ERROR: torchrun rank 0 of 2: port 127.0.0.1:{port} is in use "
                                                     "(another run?)") and err.rstrip().endswith("a free port")
    assert not (tmp_path / "out").exists()


def test_ranks_that_see_other_files_under_the_same_names_are_refused(tmp_path: Path) -> None:
    """Two nodes' local copies that are not one checkpoint (here: other cwds holding other runs): refused before
    anything is written, on both ranks; copies of one checkpoint work. On one node, other working folders would
    split the outputs between them: refused."""
    for rank, seeds in ((0, (0, 0)), (1, (0, 7))):
        for name, seed in zip(("same", "other"), seeds):
            write_shards(make_shards(make_model(seed=seed), 2), tmp_path / f"node{rank}" / name)
    for name, rc, nodes, words in (("other", 2, (0, 1), "planned other inputs or outputs than rank 0"),
                                   ("same", 2, (None, None), "would write its outputs elsewhere than another rank on "
                                                             "its node (another working folder"),
                                   ("same", 0, (0, 1), "")):
        argv = ["-m", "metaseq.scripts.reshard_fsdp", "--input", f"{name}/{SHARD.format(0, '*')}", "--output",
                f"out_{name}/s{{i}}.pt", "--num-output-shards", "4", "--quiet"]
        port = _free_port()
        procs = [_rank(r, tmp_path / f"node{r}", port, argv, node=nodes[r]) for r in (0, 1)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        assert [code for code, _ in results] == [rc, rc], results
        if rc:
            for _, err in results:
                assert f"rank 1 of 2 {words}" in _error_line(err), err
            assert not list(tmp_path.glob(f"node*/out_{name}"))
    assert sorted(p.name for p in (tmp_path / "node0" / "out_same").iterdir()) == ["s0.pt", "s2.pt"]


def test_ranks_given_other_flags_are_refused_naming_the_flag(tmp_path: Path) -> None:
    """A flag only one rank gets would make a mixed checkpoint (here: one rank drops the data position)."""
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    argv = ["-m", "metaseq.scripts.reshard_fsdp", "--input", str(tmp_path / "in" / SHARD.format(0, "*")), "--output",
            str(tmp_path / "out" / "s{i}.pt"), "--num-output-shards", "2", "--quiet"]
    port = _free_port()
    procs = [_rank(r, REPO, port, argv + ["--drop-metaseq-req"] * r) for r in (0, 1)]
    for proc in procs:
        assert proc.wait(timeout=300) == 2
        assert _error_line(proc.stderr.read()) == ("ERROR: rank 1 of 2 was given --drop-metaseq-req=True but rank 0 "
                                                   "--drop-metaseq-req=False; every rank must run the same command "
                                                   "(the same flags)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("after", ["dist.barrier()\ndist.new_group()\n", ""],  # as the tool's ranks join, or not
                         ids=["before-planning", "right-after-joining"])
def test_a_rank_that_dies_is_reported_in_one_line(parts_dir: Path, tmp_path: Path, after: str) -> None:
    """Rank 1 joins and is gone before the ranks plan (or at once, while rank 0 makes the process group it plans
    in, which waits for every rank): rank 0 says so in one line and writes nothing."""
    port = _free_port()
    dies = ("import torch.distributed as dist, os\n"
            f"dist.init_process_group('gloo', init_method='env://', rank=1, world_size=2)\n{after}os._exit(1)\n")
    procs = [_rank(0, REPO, port, ["-m", "metaseq.scripts.reshard_fsdp", "--input", _pattern(parts_dir), "--output",
                                   str(tmp_path / "out" / "s{i}.pt"), "--quiet"]),
             _rank(1, REPO, port, ["-c", dies])]
    code, err = procs[0].wait(timeout=300), procs[0].stderr.read()
    procs[1].wait(timeout=60)
    assert code == 2 and "rank 0 of 2: another rank stopped (killed?) before the ranks agreed" in _error_line(err)
    assert not (tmp_path / "out").exists()


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
    (out / "1").symlink_to("/proc")  # output 1, which rank 1 writes, cannot be made there
    proc = _torchrun(["--input", _pattern(parts_dir), "--output", str(out / "{i}" / "shard.pt"),
                      "--num-output-shards", "2"])
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: ")]
    # Both ranks report it, unless torchrun stops one (SIGTERM) as soon as the other has exited.
    assert any(f"rank 1 of 2: {out / '1' / 'shard.pt'}: cannot write" in e for e in errors), proc.stderr
    assert [p.name for p in out.rglob("*") if p.is_symlink() or p.is_file()] == ["1"]  # rank 0's output removed


def test_a_rank_whose_peers_never_start_fails_after_the_join_timeout(parts_dir, tmp_path, monkeypatch, capsys) -> None:
    """Rank 0 of 2 alone (the other task never started): one error line after JOIN_TIMEOUT, not a 12 h wait."""
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(distributed, "JOIN_TIMEOUT", timedelta(seconds=2))
    started = time.monotonic()
    assert main(["--input", _pattern(parts_dir), "--output", str(tmp_path / "out" / "s{i}.pt"), "--quiet"]) == 2
    assert time.monotonic() - started < 60
    line = _error_line(capsys.readouterr().err)
    assert f"torchrun rank 0 of 2: the ranks did not all join at 127.0.0.1:{port} within 2 s (" in line, line
    assert "check that all 2 started" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [
    {"num_output_shards": 3},
    {"unflatten_weights": True},  # tied parameters, consolidated optimizer state
    {"num_output_shards": 2, "output_dtype": "bf16", "drop_metaseq_req": True},  # cast while copying
    {"num_output_shards": 5, "skip_optimizer_state": True},
])
def test_written_files_equal_the_in_memory_reshard(tmp_path: Path, flags: dict) -> None:
    shards = make_shards(make_model(instances=BIG), 4)
    shards[0]["extra_state"]["rng"] = torch.arange(6, dtype=torch.int64)  # a carried tensor
    write_shards(shards, tmp_path / "in")
    argv = ["--input", _pattern(tmp_path / "in"), "--output", str(tmp_path / "out" / "s{i}.pt"), "--quiet"]
    argv += [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in flags.items()]
    assert main(argv) == 0
    want = reshard_shards(shards, **flags)
    got = [load_checkpoint(tmp_path / "out" / f"s{r}.pt") for r in range(len(want))]
    assert_tree_equal(got, want)
    if "unflatten_weights" in flags:
        assert got[0]["model"]["decoder.output_projection.weight"] is got[0]["model"]["decoder.embed_tokens.weight"]


def test_tensor_inside_an_object_is_carried(tmp_path: Path) -> None:
    shards = make_shards(make_model(), 2)
    shards[0]["extra_state"]["custom"] = types.SimpleNamespace(t=torch.ones(3))  # a tensor inside an object
    write_shards(shards, tmp_path / "in")
    out = tmp_path / "out" / "s{i}.pt"
    assert main(["--input", _pattern(tmp_path / "in"), "--output", str(out), "--num-output-shards", "2",
                 "--trust-checkpoint", "--quiet"]) == 0
    got = load_checkpoint(tmp_path / "out" / "s1.pt", trust=True)
    assert torch.equal(got["extra_state"]["custom"].t, torch.ones(3))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["s0.pt", "s1.pt"]  # no temp file left


@pytest.mark.parametrize("flags", [["--num-output-shards", "3"], ["--unflatten-weights"]])
def test_objects_in_the_optimizer_state_are_carried_unchanged(tmp_path: Path, flags: list[str]) -> None:
    """param_groups and scalar state are copied per output: objects of other classes must survive the copy."""
    shards = make_shards(make_model(), 2)
    for shard in shards:
        group = shard["last_optimizer_state"]["param_groups"][0]
        group["lr"], group["custom"] = np.float64(0.5), argparse.Namespace(a=[1, 2])
    write_shards(shards, tmp_path / "in")
    assert main(["--input", _pattern(tmp_path / "in"), "--output", str(tmp_path / "out" / "s{i}.pt"), *flags,
                 "--verify", "--quiet"]) == 0
    group = load_checkpoint(tmp_path / "out" / "s0.pt", trust=True)["last_optimizer_state"]["param_groups"][0]
    assert type(group["lr"]) is np.float64 and group["lr"] == 0.5 and group["custom"] == argparse.Namespace(a=[1, 2])


@pytest.mark.parametrize("tool, extra", [(main, []), (reshard_model_parallel, ["--num-output-parts", "1"])],
                         ids=["reshard_fsdp", "reshard_model_parallel"])
@pytest.mark.parametrize("signum, code, words", [(signal.SIGTERM, 2, "terminated by SIGTERM"),
                                                 (signal.SIGINT, 130, "interrupted")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_writing_removes_outputs_and_reports_one_line(parts_dir, tmp_path, monkeypatch, capsys, tool,
                                                                     extra, signum, code, words) -> None:
    saved: list[str] = []

    def then_terminated(rename):
        def renamed_then_terminated(src: str, dst: str) -> None:
            rename(src, dst)
            saved.append(str(dst))
            if len(saved) == 2:  # e.g. torchrun stopping this rank because another one failed
                os.kill(os.getpid(), signum)
        return renamed_then_terminated

    for name in ("replace", "link"):  # renames into place: os.link where no file may be replaced
        monkeypatch.setattr(os, name, then_terminated(getattr(os, name)))
    handler_before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out" / "s{i}.pt"
    assert tool(["--input", _pattern(parts_dir), "--output", str(out), "--num-output-shards", "4",
                 "--num-workers", "1", *extra]) == code
    assert words in _error_line(capsys.readouterr().err)
    assert len(saved) == 2 and not any(os.path.exists(p) for p in saved)  # the second: renamed, then the signal
    assert signal.getsignal(signal.SIGTERM) is handler_before  # main() put the previous handler back


def test_a_second_signal_cutting_a_temp_files_clean_up_short_leaves_nothing(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C during the copy, then SIGTERM (a launcher) just as the temp file's own clean-up starts: the run's
    clean-up still removes that temp file, and the output folder it made."""
    write_shards(make_shards(make_model(), 2), tmp_path / "in")
    real_copy, real_unlink, sent = os.copy_file_range, os.unlink, []

    def copy_then_interrupt(*args):
        if not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real_copy(*args)

    def terminated_first(path, *args, **kwargs):
        if len(sent) == 1 and str(path).endswith(".tmp"):  # the temp file's clean-up, cut short before it unlinks
            sent.append(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "copy_file_range", copy_then_interrupt)
    monkeypatch.setattr(os, "unlink", terminated_first)
    out = tmp_path / "out" / "new"
    assert main(["--input", _pattern(tmp_path / "in"), "--output", str(out / "s{i}.pt"), "--num-output-shards", "2",
                 "--num-workers", "1"]) == 2
    assert "terminated by SIGTERM" in _error_line(capsys.readouterr().err) and sent == [signal.SIGINT, signal.SIGTERM]
    assert not (tmp_path / "out").exists(), list((tmp_path / "out").rglob("*"))


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
    want = reshard_shards(make_shards(make_model(), 100), num_output_shards=2)
    assert_tree_equal([load_checkpoint(tmp_path / "out" / f"s{r}.pt") for r in range(2)], want)


def test_an_interrupt_stops_the_other_writers_within_a_chunk(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C (or SIGTERM) with several writer threads: each stops after the chunk it is copying, not at the end of
    its file (which for a big shard outlasts a scheduler's grace period); nothing is left."""
    model = make_model(instances=(("", (("decoder.w", (1024, 2048)),), ()),))  # each output: 3 copies of 4 MiB
    write_shards(make_shards(model, 2), tmp_path / "in")
    monkeypatch.setattr(torchzip, "CHUNK_BYTES", 1 << 20)  # so 12 chunks per output
    real_copy, calls = os.copy_file_range, []

    def copy_then_interrupt(*args):  # a slow disk: 20 ms a chunk
        calls.append(args)
        if len(calls) == 2:  # (appended by two threads at once, it can also be seen as 2 twice: a second Ctrl-C)
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.02)
        return real_copy(*args)

    monkeypatch.setattr(os, "copy_file_range", copy_then_interrupt)
    out = tmp_path / "out"
    assert main(["--input", str(tmp_path / "in" / "*.pt"), "--output", str(out / "s{i}.pt"),
                 "--num-output-shards", "2", "--num-workers", "2"]) == 130
    assert "interrupted" in _error_line(capsys.readouterr().err)
    assert len(calls) <= 6, len(calls)  # of 24: about one more chunk per writer after the signal
    assert not out.exists() or not list(out.iterdir())
