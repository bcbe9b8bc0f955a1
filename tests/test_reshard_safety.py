"""Outputs are atomic (SIGKILL, full disk), temp files never linger, --verify, and corruption fuzzing.

What a run may leave at a final output path: nothing, or a complete file that loads
and equals a clean run's. Inputs are never changed (checked by sha256).
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from metaseq.file_io import atomic_torch_save, load_checkpoint, remove_stale_temp_files_in
from metaseq.reshard import ReshardError, ReshardOptions, reshard
from metaseq.reshard.verify import verify_reshard_outputs
from metaseq.scripts.reshard_fsdp import main
from synthetic import assert_tree_equal, make_model, make_shards, write_shards

REPO = Path(__file__).resolve().parents[1]
HARNESS = Path(__file__).resolve().parent / "kill_harness.py"
SHARD = "checkpoint_last-model_part-0-shard{}.pt"
# About 85 KB of tensors per output shard at M = 3 (weights, exp_avg, exp_avg_sq).
BIG = (
    ("", (("decoder.embed_tokens.weight", (200, 64)), ("decoder.layer_norm.weight", (64,))),
     (("decoder.embed_tokens.weight", "decoder.output_projection.weight"),)),
    ("decoder.layers.0", (("fc1.weight", (128, 64)), ("fc1.bias", (128,))), ()),
)
CLEAN_ERROR = re.compile(r"ERROR: (?![A-Za-z]*(Error|Exception|Interrupt): )")  # not an unexpected exception type


def _sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert CLEAN_ERROR.match(errors[0]), errors[0]
    return errors[0]


@pytest.fixture
def big_dir(tmp_path: Path) -> Path:
    write_shards(make_shards(make_model(instances=BIG), 4), tmp_path / "ckpts")
    return tmp_path / "ckpts"


def _outputs(folder: Path, m: int = 3) -> list[Path]:
    return [folder / f"shard{r}.pt" for r in range(m)]


# --- SIGKILL while writing -----------------------------------------------------------------------


KILLS = {  # kill point -> which outputs exist afterwards
    ("bytes", 1): [],
    ("bytes", 40_000): [],
    ("bytes", 130_000): [0],
    ("replace", 1): [],
    ("replace", 3): [0, 1],
    ("renamed", 1): [0],
    ("renamed", 3): [0, 1, 2],
}


def test_sigkill_while_writing_leaves_only_complete_outputs(big_dir: Path, tmp_path: Path) -> None:
    inputs = _sha(big_dir)
    clean = tmp_path / "clean"
    argv = ["--input", str(big_dir / SHARD.format("*")), "--num-output-shards", "3", "--quiet"]
    assert main([*argv, "--output", str(clean / "shard{i}.pt")]) == 0
    procs = {}
    for (point, k) in KILLS:  # all at once: they only write to their own folders
        out = tmp_path / f"kill_{point}_{k}" / "shard{i}.pt"
        cmd = [sys.executable, str(HARNESS), point, str(k), *argv, "--output", str(out)]
        procs[(point, k)] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for (point, k), proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, f"{point} {k}: rc {proc.returncode}: {err.decode()}"
        folder = tmp_path / f"kill_{point}_{k}"
        present = [r for r, path in enumerate(_outputs(folder)) if path.exists()]
        assert present == KILLS[(point, k)], f"{point} {k}"
        for r in present:  # complete and loadable, equal to the clean run's
            got, want = load_checkpoint(_outputs(folder)[r]), load_checkpoint(_outputs(clean)[r])
            assert_tree_equal(got, want, f"{point} {k} output {r}")
        assert sorted(folder.glob("*.pt")) == [_outputs(folder)[r] for r in present]  # temp files never match
    assert _sha(big_dir) == inputs


def test_rerun_after_sigkill_cleans_temp_files_and_completes(big_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--input", str(big_dir / SHARD.format("*")), "--output", str(out / "shard{i}.pt"),
            "--num-output-shards", "3", "--quiet"]
    proc = subprocess.run([sys.executable, str(HARNESS), "bytes", "130000", *argv], cwd=REPO, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".shard1.pt.")
    assert main([*argv, "--overwrite", "--verify"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shard0.pt", "shard1.pt", "shard2.pt"]


# --- temp files ----------------------------------------------------------------------------------


def test_stale_temp_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".shard0.pt.{dead.pid}.abcd1234.tmp"
    legacy = out / ".shard1.pt.zz99yy88.tmp"  # written before temp names carried a pid
    live = out / f".shard0.pt.{os.getppid()}.abcd1234.tmp"  # our parent is running
    unrelated = out / f".other.pt.{dead.pid}.abcd1234.tmp"
    for path in (stale, legacy, live, unrelated):
        path.write_bytes(b"partial")
    write_shards(make_shards(make_model(), 2), tmp_path / "ckpts")
    argv = ["--input", str(tmp_path / "ckpts" / SHARD.format("*")), "--output", str(out / "shard{i}.pt"),
            "--num-output-shards", "2", "--quiet"]
    assert main(argv) == 0
    assert not stale.exists() and not legacy.exists()
    assert live.exists() and unrelated.exists()
    assert sorted(p.name for p in out.glob("*.pt")) == ["shard0.pt", "shard1.pt"]


def test_a_folders_temp_files_of_dead_writers_are_removed_whatever_their_name(tmp_path: Path) -> None:
    """What training clears in --save-dir once its ranks are gone (stopped while saving)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".checkpoint_2-model_part-0-shard{i}.pt.{dead.pid}.abcd123{i}.tmp" for i in range(2)]
    live = tmp_path / f".checkpoint_2-model_part-0-shard0.pt.{os.getppid()}.abcd1234.tmp"
    for path in (*stale, live, tmp_path / "checkpoint_1-model_part-0-shard0.pt"):
        path.write_bytes(b"partial")
    remove_stale_temp_files_in(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "checkpoint_1-model_part-0-shard0.pt"])


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save({"a": 1}, path)
    before = path.read_bytes()
    with pytest.raises(Exception):
        atomic_torch_save({"f": lambda: 0}, path)  # a lambda cannot be pickled
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


# --- full disk -----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """A 128 KiB tmpfs where this process may mount one (root); else a 128 KiB file size limit.

    Yields the folder and a `preexec_fn` for the subprocess that writes there: writes past
    128 KiB then fail for real, with ENOSPC (tmpfs) or EFBIG (the limit).
    """
    folder = tmp_path / "small"
    folder.mkdir()
    try:
        cmd = ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(folder)]
        mounted = subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # no mount binary
        mounted = False

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, 128 << 10))

    try:
        yield folder, None if mounted else limit_file_size
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_full_disk_is_a_clean_error_and_leaves_nothing(big_dir: Path, small_disk, workers: str) -> None:
    folder, preexec = small_disk
    inputs = _sha(big_dir)
    cmd = [sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input", str(big_dir / SHARD.format("*")),
           "--output", str(folder / "new" / "sub" / "shard{i}.pt"), "--num-output-shards", "3",
           "--num-workers", workers]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, preexec_fn=preexec)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    written = rf"{folder}/new/sub/shard\d\.pt: cannot write \((No space left on device|File too large)\)"
    assert re.search(written, line), line
    assert list(folder.iterdir()) == []  # neither the outputs already written, nor temp files, nor the new folders
    assert _sha(big_dir) == inputs


# --- --verify ------------------------------------------------------------------------------------


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    write_shards(make_shards(make_model(), 4), tmp_path / "ckpts")
    return tmp_path / "ckpts"


@pytest.mark.parametrize(
    "extra, report",
    [
        (["--num-output-shards", "3"], "verified 3 output(s): 10 parameters, 2 buffers, 16 optimizer tensors "
         "bit-identical to the inputs, 8 optimizer scalars and the optimizer settings equal; metadata consistent"),
        (["--unflatten-weights", "--output-dtype", "bf16"], "verified 1 output(s): 10 parameters, 2 buffers, 16"),
        (["--num-output-shards", "7", "--skip-optimizer-state"], "verified 7 output(s): 10 parameters, 2 buffers, 0"),
    ],
)
def test_verify_reports_what_it_checked(shard_dir: Path, tmp_path: Path, capsys, extra: list[str], report: str) -> None:
    argv = ["--input", str(shard_dir / SHARD.format("*")), "--output", str(tmp_path / "out" / "shard{i}.pt"), "--verify"]
    assert main([*argv, *extra]) == 0
    err = capsys.readouterr().err
    assert "inputs match their CRC32 checksums (4 file(s)" in err
    assert report in err


def test_verify_warns_of_inputs_whose_tensor_data_has_no_crc32s(shard_dir: Path, tmp_path: Path, capsys) -> None:
    """Outputs written without --verify carry CRC32s for their pickle only: resharding them again with --verify says
    that their tensor data goes unchecked; outputs written with it check in full."""
    argv = ["--input", str(shard_dir / SHARD.format("*")), "--num-output-shards", "2", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "plain" / "shard{i}.pt")]) == 0
    assert main([*argv, "--output", str(tmp_path / "checked" / "shard{i}.pt"), "--verify"]) == 0
    capsys.readouterr()
    for folder, warned in (("plain", True), ("checked", False)):
        assert main(["--input", str(tmp_path / folder / "shard*.pt"), "--output", str(tmp_path / f"{folder}.pt"),
                     "--unflatten-weights", "--verify", "--quiet"]) == 0
        err = capsys.readouterr().err
        assert ("2 input(s) carry no CRC32s for some or all of their data" in err) is warned, err


def test_verify_names_what_of_the_outputs_metadata_differs_from_the_plan(shard_dir: Path, tmp_path: Path) -> None:
    """An output replaced after writing (flat, without optimizer state, where the plan wrote it unflattened with
    it) is refused by name and removed."""
    out, pattern = tmp_path / "out" / "whole.pt", str(shard_dir / SHARD.format("*"))
    (plan,) = reshard(ReshardOptions(input_glob_pattern=pattern, output_shard_name=str(out), unflatten_weights=True,
                                     quiet=True))
    reshard(ReshardOptions(input_glob_pattern=pattern, output_shard_name=str(out), skip_optimizer_state=True,
                           overwrite=True, quiet=True))
    with pytest.raises(ReshardError, match=f"{re.escape(str(out))}: its form and optimizer state differ from the plan"):
        verify_reshard_outputs(plan)
    assert not out.exists()


def _tensor_record_span(data: bytes, record: str) -> tuple[int, int]:
    """[start, end) of a record's bytes (after its local header) in a torch zip file."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.filename.endswith(record))
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.compress_size


def test_flipped_tensor_bit_passes_unnoticed_without_verify_and_is_caught_with_it(big_dir, tmp_path, capsys) -> None:
    path = big_dir / SHARD.format(2)
    data = bytearray(path.read_bytes())
    start, _ = _tensor_record_span(bytes(data), "/data/0")
    data[start + 2] ^= 0x10  # one bit of one weight: still loads
    path.write_bytes(bytes(data))
    argv = ["--input", str(big_dir / SHARD.format("*")), "--num-output-shards", "2", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "plain" / "shard{i}.pt")]) == 0  # tensor data has no CRC check
    capsys.readouterr()
    assert main([*argv, "--output", str(tmp_path / "checked" / "shard{i}.pt"), "--verify"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{path}: corrupt checkpoint (record data/0 fails its CRC32 check)" in line
    assert not (tmp_path / "checked").exists()


def test_flipped_bit_in_a_small_tensor_is_caught_without_verify(shard_dir, tmp_path, capsys) -> None:
    """Storages of at most 64 bytes (steps, tiny flat parameters) are read with the pickle, CRC32 checked."""
    path = shard_dir / SHARD.format(2)
    data = bytearray(path.read_bytes())
    start, end = _tensor_record_span(bytes(data), "/data/0")
    assert end - start <= 64
    data[start + 2] ^= 0x10
    path.write_bytes(bytes(data))
    argv = ["--input", str(shard_dir / SHARD.format("*")), "--output", str(tmp_path / "o{i}.pt"), "--num-output-shards", "2"]
    assert main(argv) == 2
    assert f"{path}: corrupt checkpoint (record data/0 fails its CRC32 check)" in _one_error_line(capsys.readouterr().err)
    assert not list(tmp_path.glob("o*.pt"))


def test_verify_failure_names_the_tensor_and_removes_outputs(big_dir, tmp_path, monkeypatch, capsys) -> None:
    """A writer that puts wrong bytes into an output is caught by re-reading and comparing it.

    Simulated at the OS boundary: copies go through pread/pwrite (as on file systems without
    copy_file_range), and one bit of the first tensor bytes read from an input for shard1.pt
    is flipped as they are written. The CRC32s are then those of the wrong bytes, so only
    the comparison with the inputs can notice.
    """
    real_pread, real_pwrite = os.pread, os.pwrite
    state = {"armed": False, "flipped": False}

    def no_copy_file_range(*args: Any) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    def pread(fd: int, n: int, offset: int) -> bytes:
        state["armed"] = str(big_dir) in os.readlink(f"/proc/self/fd/{fd}")
        return real_pread(fd, n, offset)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if state["armed"] and not state["flipped"] and ".shard1.pt." in os.readlink(f"/proc/self/fd/{fd}"):
            data = bytearray(data)
            data[3] ^= 0x01  # the exponent of the first float32
            state["flipped"] = True
        state["armed"] = False
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "copy_file_range", no_copy_file_range)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "pwrite", pwrite)
    out = tmp_path / "out"
    argv = ["--input", str(big_dir / SHARD.format("*")), "--output", str(out / "shard{i}.pt"),
            "--num-output-shards", "3", "--verify", "--num-workers", "1"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert state["flipped"] and "--verify failed, outputs removed:" in line, line
    assert re.search(r"difference\(s\) between the outputs and the inputs, first decoder\.[\w.]+: max abs diff", line)
    assert not out.exists()  # the outputs, and the folder the run made for them, are gone


# --- corruption fuzzing --------------------------------------------------------------------------


@pytest.fixture
def fuzz(tmp_path: Path) -> tuple[Path, bytes, dict[str, Any], list[tuple[int, int]]]:
    """2 small shards, shard 1's clean bytes, a clean run's output, and shard 1's tensor-record spans."""
    paths = write_shards(make_shards(make_model(), 2), tmp_path / "ckpts")
    assert main(["--input", str(tmp_path / "ckpts" / "*.pt"), "--output", str(tmp_path / "clean.pt"), "--quiet"]) == 0
    data = paths[1].read_bytes()
    spans = []
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        if re.fullmatch(r"[^/]+/data/\d+", info.filename):  # local header and data of a tensor storage
            spans.append((info.header_offset, _tensor_record_span(data, info.filename)[1]))
    return paths[1], data, load_checkpoint(tmp_path / "clean.pt"), spans


def _run_corrupted(path: Path, data: bytes, out: Path, capsys, *extra: str) -> int:
    path.write_bytes(data)
    rc = main(["--input", str(path.parent / "*.pt"), "--output", str(out), "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc in (0, 2) and "Traceback" not in err
    if rc == 2:
        _one_error_line(err)
        assert not out.exists()
    return rc


@pytest.mark.parametrize("verify", [False, True])
def test_byte_flips_are_detected_or_provably_harmless(fuzz, tmp_path: Path, capsys, verify: bool) -> None:
    """Every record but tensor data is CRC-checked on load, and tensor data too with --verify.

    So a flip either fails cleanly or leaves outputs identical to a clean run's, except
    a flip inside tensor data without --verify: torch.load cannot notice it, the run
    succeeds and the corrupted value is carried (that is what --verify is for).
    """
    path, data, want, spans = fuzz
    detected = 0
    for i, pos in enumerate(range(0, len(data), 23)):
        flipped = bytearray(data)
        flipped[pos] ^= 0xFF
        out = tmp_path / f"out{i}.pt"
        if _run_corrupted(path, bytes(flipped), out, capsys, *(["--verify"] if verify else [])) == 2:
            detected += 1
            continue
        got = load_checkpoint(out)
        if verify or not any(a <= pos < b for a, b in spans):
            assert_tree_equal(got, want, f"flip at {pos}")
        else:
            assert got.keys() == want.keys()
        out.unlink()
    assert detected > len(data) // 23 // 2


def test_truncations_always_fail_cleanly(fuzz, tmp_path: Path, capsys) -> None:
    path, data, _, _ = fuzz
    for cut in sorted({*range(0, len(data), len(data) // 25), len(data) - 22, len(data) - 1}):
        assert _run_corrupted(path, data[:cut], tmp_path / "out.pt", capsys) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip-pickle"])
def test_corrupt_input_through_python_m_is_one_line(fuzz, tmp_path: Path, damage: str) -> None:
    path, data, _, _ = fuzz
    broken = bytearray(data[: len(data) // 2] if damage == "truncate" else data)
    if damage == "flip-pickle":
        broken[broken.index(b"CrossEntropyCriterion") + 3] ^= 0x01
    path.write_bytes(bytes(broken))
    cmd = [sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input", str(path.parent / "*.pt"),
           "--output", str(tmp_path / "out.pt"), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    line = _one_error_line(proc.stderr)
    assert line == proc.stderr.strip() and f"{path}: corrupt checkpoint" in line
    assert not (tmp_path / "out.pt").exists()


def test_an_output_another_process_writes_meanwhile_is_left_as_it_is(tmp_path: Path, capsys) -> None:
    """Without --overwrite no file is replaced, also one that appears after planning; and a failed run removes what
    it wrote, not that file."""
    model = make_model(instances=(("", (("decoder.w", (1024, 2048)),), ()),))  # outputs of about 12 MiB
    write_shards(make_shards(model, 2), tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()

    def intrude() -> None:  # once output 0 is being written, "another process" writes output 1's name
        deadline = time.monotonic() + 60
        while not list(out.glob(".s0.pt.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.0005)
        (out / "s1.pt").write_bytes(b"precious")

    thread = threading.Thread(target=intrude, daemon=True)
    thread.start()
    argv = ["--input", str(tmp_path / "in" / "*.pt"), "--output", str(out / "s{i}.pt"), "--num-output-shards", "2",
            "--num-workers", "1", "--quiet"]
    assert main(argv) == 2
    thread.join(60)
    assert f"{out / 's1.pt'} appeared while resharding (another process wrote it?)" in _one_error_line(
        capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == ["s1.pt"] and (out / "s1.pt").read_bytes() == b"precious"
