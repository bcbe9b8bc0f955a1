"""The deprecated `reshard_mp` shims forward to reshard_fsdp: same files, a logged replacement, launchers."""
import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metaseq.file_io import load_checkpoint
from metaseq.scripts import reshard_fsdp

REPO = Path(__file__).resolve().parents[1]
DEPRECATED = REPO / "deprecated"
SHIM = DEPRECATED / "reshard_mp.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)


def _import_shim():
    spec = importlib.util.spec_from_file_location("deprecated_reshard_mp", SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=ENV, timeout=120, **kwargs)


def assert_same_checkpoint(a, b, where="checkpoint"):
    """Every key, tensor (values and dtype) and metadata value equal."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b), f"{where}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b) if isinstance(b, dict) else b}"
        for key in a:
            assert_same_checkpoint(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_checkpoint(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _assert_same_files(paths_a, paths_b):
    assert len(paths_a) == len(paths_b)
    for pa, pb in zip(paths_a, paths_b):
        assert_same_checkpoint(load_checkpoint(pa), load_checkpoint(pb), where=Path(pa).name)


def _logged_replacement(stderr: str) -> list[str]:
    """The argv of the `python -m metaseq.scripts.reshard_fsdp ...` line the shim logged."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip().startswith("python -m metaseq.scripts.reshard_fsdp ")]
    assert len(lines) == 1, stderr
    return shlex.split(lines[0])[3:]


@pytest.mark.parametrize(
    "w, flags, skip_optimizer_state",
    [(4, [], False), (2, ["--drop-optimizer-state", "True", "--no-pad"], True)],
    ids=["w4-keep-optimizer", "w2-drop-optimizer"],
)
def test_shim_writes_the_same_files_as_reshard_fsdp(trained, tmp_path, w, flags, skip_optimizer_state):
    save_dir, _ = trained[w]
    prefix = save_dir / "checkpoint_last"
    proc = _run([sys.executable, SHIM, prefix, tmp_path / "shim", "--target-ddp-size", "3", *flags])
    assert proc.returncode == 0, proc.stderr

    # The warning comes before anything else and names the replacement and the removal release.
    assert proc.stderr.startswith("WARNING: deprecated/reshard_mp.py is deprecated and will be removed after release 0.3")
    assert "DeprecationWarning" in proc.stderr
    if "--no-pad" in flags:
        assert "--no-pad is ignored" in proc.stderr

    direct = reshard_fsdp.reshard_fsdp_checkpoints(
        f"{prefix}-model_part-0-shard*.pt",
        str(tmp_path / "direct" / "shard{i}.pt"),
        num_output_shards=3,
        skip_optimizer_state=skip_optimizer_state,
    )
    shimmed = [tmp_path / "shim" / f"reshard-model_part-0-shard{i}.pt" for i in range(3)]
    _assert_same_files(shimmed, direct)
    assert ("last_optimizer_state" in load_checkpoint(shimmed[0])) is not skip_optimizer_state

    # The logged command is accepted by the new CLI and names the same files.
    args = reshard_fsdp.build_parser().parse_args(_logged_replacement(proc.stderr))
    assert args.input_glob_pattern == f"{prefix}-model_part-0-shard*.pt"
    assert args.output_shard_name.replace("{i}", "0") == str(shimmed[0])
    assert (args.num_output_shards, args.skip_optimizer_state) == (3, skip_optimizer_state)


def test_shim_warns_in_process_with_deprecation_warning(trained, tmp_path, caplog):
    shim = _import_shim()
    save_dir, _ = trained[2]
    argv = [str(save_dir / "checkpoint_4"), str(tmp_path), "--target_ddp_size", "1", "--drop_optimizer_state"]
    with pytest.warns(DeprecationWarning, match="removed after release 0.3"):
        assert shim.main(argv) == 0
    warning = next(r for r in caplog.records if r.name == "deprecated.reshard_mp")
    assert "python -m metaseq.scripts.reshard_fsdp --input-glob-pattern" in warning.getMessage()
    out = load_checkpoint(tmp_path / "reshard-model_part-0-shard0.pt")
    assert "last_optimizer_state" not in out
    assert out["optimizer_history"][-1]["num_updates"] == 4


@pytest.mark.parametrize(
    "flags, skip",
    [([], False), (["--drop-optimizer-state"], True), (["--drop-optimizer-state", "false"], False),
     (["--drop_optimizer_state", "True"], True)],
)
def test_replacement_command_maps_old_flags(flags, skip):
    shim = _import_shim()
    args = shim.parse_args(["ck/checkpoint_last", "out dir", "--part", "2", *flags])
    new = reshard_fsdp.build_parser().parse_args(shim.replacement_argv(args))
    assert new.input_glob_pattern == "ck/checkpoint_last-model_part-2-shard*.pt"
    assert new.output_shard_name == "out dir/reshard-model_part-2-shard{i}.pt"
    assert new.num_output_shards == 512  # the old default
    assert new.skip_optimizer_state is skip
    assert new.unflatten_weights is False  # the old tool kept weights flat
    command = shim.replacement_command(shim.replacement_argv(args))
    assert shlex.split(command)[:3] == ["python", "-m", "metaseq.scripts.reshard_fsdp"]
    assert "'out dir/reshard-model_part-2-shard{i}.pt'" in command  # quoted: copy-pasteable


@pytest.mark.parametrize("flags, message", [(["--target-ddp-size", "0"], "--target-ddp-size=0"), (["--part", "-1"], "--part=-1")])
def test_shim_rejects_bad_sizes_naming_the_flag(flags, message, capsys):
    shim = _import_shim()
    with pytest.raises(SystemExit) as exc:
        shim.main(["ck/checkpoint_last", "out", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def two_parts(trained, tmp_path):
    """Shards of W=2 as model parts 0 and 1 (part 1: copies renamed), prefix in tmp_path."""
    save_dir, _ = trained[2]
    src = tmp_path / "src"
    src.mkdir()
    for rank in range(2):
        shard = save_dir / f"checkpoint_last-model_part-0-shard{rank}.pt"
        for part in range(2):
            shutil.copy(shard, src / f"checkpoint_last-model_part-{part}-shard{rank}.pt")
    return src / "checkpoint_last"


def _assert_both_parts_written(out_dir, target):
    for part in range(2):
        files = sorted(out_dir.glob(f"reshard-model_part-{part}-shard*.pt"))
        assert [f.name for f in files] == [f"reshard-model_part-{part}-shard{i}.pt" for i in range(target)]
    # Part 1 is a renamed copy of part 0, so its outputs are the same but for the ranks in cfg: part 0's say theirs,
    # part 1's cannot (their cfg says the model has one part) and keep their input 0's.
    for i in range(target):
        a, b = (load_checkpoint(out_dir / f"reshard-model_part-{j}-shard{i}.pt") for j in (0, 1))
        assert a["cfg"]["distributed_training"].pop("distributed_rank") == i
        assert b["cfg"]["distributed_training"].pop("distributed_rank") == 0
        assert_same_checkpoint(a, b, where=f"shard{i}")


def test_no_slurm_launcher_reshards_every_part(two_parts, tmp_path):
    out = tmp_path / "out"
    proc = _run(["bash", DEPRECATED / "reshard_mp_launch_no_slurm.sh", two_parts, out, 2, 3])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("WARNING: reshard_mp_launch_no_slurm.sh is deprecated")
    assert proc.stderr.count("python -m metaseq.scripts.reshard_fsdp --input-glob-pattern") >= 2
    assert "Done: wrote 3 shard(s) for each of 2 model part(s)" in proc.stdout
    _assert_both_parts_written(out, 3)


def test_one_output_with_optimizer_state_is_named_as_the_old_tool_named_it(two_parts, tmp_path):
    """`... 8 1` of OPT's serving recipe: reshard-model_part-J.pt; with the state dropped, -shard0 as before."""
    proc = _run(["bash", DEPRECATED / "reshard_mp_launch_no_slurm.sh", two_parts, tmp_path / "kept", 2, 1])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "kept").glob("*.pt")) == [f"reshard-model_part-{j}.pt" for j in (0, 1)]
    assert "last_optimizer_state" in load_checkpoint(tmp_path / "kept" / "reshard-model_part-1.pt")
    proc = _run([sys.executable, SHIM, two_parts, tmp_path / "dropped", "1", "1", "--drop_optimizer_state", "True"])
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "dropped").glob("*.pt")] == ["reshard-model_part-1-shard0.pt"]


@pytest.mark.parametrize("argv, part, size", [(["2", "8"], 2, 8), (["2"], 2, 512), (["--target_ddp_size", "8"], 0, 8)])
def test_part_and_size_are_taken_positionally_too(argv, part, size):
    args = _import_shim().parse_args(["ck/checkpoint_last", "out", *argv])
    assert (args.part, args.target_ddp_size) == (part, size)


def test_no_slurm_launcher_names_the_failed_part(two_parts, tmp_path):
    for rank in range(2):  # part 1 now has no shards
        Path(f"{two_parts}-model_part-1-shard{rank}.pt").unlink()
    proc = _run(["bash", DEPRECATED / "reshard_mp_launch_no_slurm.sh", two_parts, tmp_path / "out", 2, 3])
    assert proc.returncode != 0
    assert "error: model part(s) 1 of 0..1 failed" in proc.stderr
    assert "[part 1] ERROR: --input-glob-pattern" in proc.stderr
    assert "Done" not in proc.stdout
    assert not list((tmp_path / "out").glob("reshard-model_part-1-*"))


def _fake_srun(bin_dir: Path, log: Path) -> None:
    """An `srun` that records its arguments, drops its own options and runs the command."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        "#!/usr/bin/env bash\n"
        f"printf '%s\\n' \"$*\" >> {shlex.quote(str(log))}\n"
        'while [[ $# -gt 0 && $1 == --* ]]; do shift; done\n'
        'exec "$@"\n'
    )
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)


def test_slurm_launcher_submits_one_srun_per_part(two_parts, tmp_path):
    log = tmp_path / "srun.log"
    _fake_srun(tmp_path / "bin", log)
    env = dict(ENV, PATH=f"{tmp_path / 'bin'}{os.pathsep}{ENV['PATH']}")
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(DEPRECATED / "reshard_mp_launch.sh"), str(two_parts), str(out), "2", "2"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("WARNING: reshard_mp_launch.sh is deprecated")
    calls = sorted(log.read_text().splitlines())
    assert len(calls) == 2
    for part, call in enumerate(calls):
        assert call.startswith(f"--job-name=reshard_mp_part{part} --nodes=1 --ntasks=1 {sys.executable} ")
        assert call.endswith(f"reshard_mp.py {two_parts} {out} --part {part} --target-ddp-size 2")
    _assert_both_parts_written(out, 2)


def test_slurm_launcher_without_srun_points_to_no_slurm_variant(tmp_path):
    path = "/usr/bin:/bin"
    if shutil.which("srun", path=path):
        pytest.skip("srun is installed in /usr/bin or /bin")
    proc = subprocess.run(
        ["bash", str(DEPRECATED / "reshard_mp_launch.sh"), str(tmp_path / "ck"), str(tmp_path / "out"), "2", "8"],
        capture_output=True, text=True, env=dict(ENV, PATH=path), timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("WARNING: reshard_mp_launch.sh is deprecated")
    assert "srun is not on PATH" in proc.stderr
    assert "reshard_mp_launch_no_slurm.sh" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_upstream_form_forwards_to_reshard_model_parallel(mp_runs, tmp_path):
    """Upstream's later `reshard_mp --input ... --output ...{i}... --num-output-parts Q` (consolidated parts)."""
    save_dir, _ = mp_runs["p2"]
    assert reshard_fsdp.main(["--input", str(save_dir / "checkpoint_last-model_part-{j}-shard*.pt"),
                              "--output", str(tmp_path / "parts" / "reshard-model_part-{j}.pt"),
                              "--unflatten-weights", "--skip-optimizer-state", "--quiet"]) == 0
    proc = _run([sys.executable, SHIM, "--input", tmp_path / "parts" / "reshard-model_part-*.pt",
                 "--output", tmp_path / "one" / "reshard-model_part-{i}.pt", "--num-output-parts", "1"], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "deprecated" in proc.stderr and "python -m metaseq.scripts.reshard_model_parallel" in proc.stderr
    merged = load_checkpoint(tmp_path / "one" / "reshard-model_part-0.pt")
    assert "last_optimizer_state" not in merged  # weights only, as upstream's tool wrote
    assert merged["model"]["decoder.embed_tokens.weight"].shape[0] == 260  # both parts' vocabulary rows
