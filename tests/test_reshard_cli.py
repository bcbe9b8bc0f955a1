"""CLI tests of `python -m metaseq.scripts.reshard_fsdp`, mostly through `main([...])`."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from metaseq.file_io import find_shards, load_checkpoint
from metaseq.scripts.reshard_fsdp import build_parser, main
from synthetic import LOADS, Opaque, assert_tree_equal, make_model, make_shards, write_shards

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """4 training shards of model part 0 in tmp_path/ckpts."""
    write_shards(make_shards(make_model(), 4), tmp_path / "ckpts")
    return tmp_path / "ckpts"


def _pattern(folder: Path) -> str:
    return str(folder / "checkpoint_last-model_part-0-shard*.pt")


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _error_line(capsys: pytest.CaptureFixture) -> str:
    """The one ERROR line on stderr (INFO lines may precede it; no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1, err
    assert err.rstrip().endswith(errors[0])
    return errors[0]


def test_reshard_to_two_and_back_reproduces_the_files(shard_dir: Path, tmp_path: Path) -> None:
    two = tmp_path / "two" / "checkpoint_last-model_part-0-shard{i}.pt"
    assert main(["--input", _pattern(shard_dir), "--output", str(two), "--num-output-shards", "2", "--quiet"]) == 0
    back = tmp_path / "back" / "checkpoint_last-model_part-0-shard{i}.pt"
    assert main(["--input", _pattern(tmp_path / "two"), "--output", str(back), "--num-output-shards", "4"]) == 0
    for rank in range(4):
        got = load_checkpoint(str(back).replace("{i}", str(rank)))
        want = load_checkpoint(shard_dir / f"checkpoint_last-model_part-0-shard{rank}.pt")
        for key in ("model", "shard_metadata", "last_optimizer_state", "optimizer_history"):
            assert_tree_equal(got[key], want[key], key)


def test_unflatten_writes_original_names_for_inference(shard_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "reshard-model_part-0.pt"
    argv = ["--input-glob-pattern", _pattern(shard_dir), "--output-shard-name", str(out),
            "--num-output-shards", "1", "--skip-optimizer-state", "True", "--unflatten-weights", "True"]
    assert main(argv) == 0
    got = load_checkpoint(out)
    assert_tree_equal(got["model"], make_model().state_dict())
    assert "last_optimizer_state" not in got


@pytest.mark.parametrize(
    "flags, skip, unflatten",
    [
        ([], False, False),
        (["--skip-optimizer-state"], True, False),
        (["--skip-optimizer-state", "True", "--unflatten-weights", "false"], True, False),
        (["--skip-optimizer-state", "0", "--unflatten-weights", "yes"], False, True),
        (["--unflatten-weights", "--no-skip-optimizer-state"], False, True),
        (["--skip-optimizer-state", "--no-skip-optimizer-state"], False, False),
    ],
)
def test_bool_flags_accept_bare_true_false_and_no_prefix(flags: list[str], skip: bool, unflatten: bool) -> None:
    args = build_parser().parse_args(["--input", "a", "--output", "b", *flags])
    assert (args.skip_optimizer_state, args.unflatten_weights) == (skip, unflatten)


def test_bad_bool_value_is_a_one_line_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["--input", "a", "--output", "b", "--unflatten-weights", "maybe"]) == 2
    assert "expected True or False, got 'maybe'" in _error_line(capsys)


def test_dry_run_prints_plan_and_writes_nothing(shard_dir: Path, tmp_path: Path, capsys) -> None:
    before = _files(tmp_path)
    out = str(tmp_path / "out" / "shard{i}.pt")
    assert main(["--input", _pattern(shard_dir), "--output", out, "--num-output-shards", "3", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert _files(tmp_path) == before
    assert "4 shard(s) -> 3 flat shard(s)" in plan
    assert "output 2:" in plan and "bytes of tensors" in plan
    assert "reads " + str(shard_dir / "checkpoint_last-model_part-0-shard3.pt") in plan


def test_inputs_are_ordered_naturally(tmp_path: Path) -> None:
    write_shards(make_shards(make_model(), 11), tmp_path)
    paths = find_shards(str(tmp_path / "*.pt"))
    assert [Path(p).name for p in paths] == [f"checkpoint_last-model_part-0-shard{r}.pt" for r in range(11)]


def test_several_outputs_require_index_placeholder(shard_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["--input", _pattern(shard_dir), "--output", str(tmp_path / "o.pt"), "--num-output-shards", "2"]) == 2
    assert "--num-output-shards=2 but --output-shard-name" in _error_line(capsys)
    assert not (tmp_path / "o.pt").exists()


def test_bare_output_file_name_writes_to_working_directory(shard_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--input", _pattern(shard_dir), "--output", "consolidated.pt", "--unflatten-weights"]) == 0
    assert "decoder.layers.0.fc_tied.weight" in load_checkpoint(tmp_path / "consolidated.pt")["model"]


def test_quoted_tilde_means_the_home_folder_in_both_names(shard_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(shard_dir)
    assert main(["--input", "~/ckpts/checkpoint_last-model_part-0-shard*.pt", "--output", "~/out/s{i}.pt",
                 "--num-output-shards", "2", "--quiet"]) == 0
    assert _files(tmp_path / "out") == {"s0.pt", "s1.pt"} and not (shard_dir / "~").exists()
    assert find_shards("~/out/s*.pt") == [str(tmp_path / "out" / f"s{i}.pt") for i in range(2)]


def test_input_folder_named_with_brackets_is_found(shard_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run[1]"
    shard_dir.rename(folder)
    assert main(["--input", _pattern(folder), "--output", str(tmp_path / "one.pt"), "--quiet"]) == 0
    assert find_shards(str(folder / "*-shard*.pt")) == [str(folder / f"checkpoint_last-model_part-0-shard{i}.pt")
                                                        for i in range(4)]


def test_overwrite_replaces_an_existing_output(shard_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    out.write_bytes(b"keep me")
    assert main(["--input", _pattern(shard_dir), "--output", str(out), "--overwrite"]) == 0
    assert "shard_metadata" in load_checkpoint(out)


def test_drop_metaseq_req_and_dtype_reach_the_file(shard_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.pt"
    assert main(["--input", _pattern(shard_dir), "--output", str(out), "--drop-metaseq-req", "--output-dtype", "fp16"]) == 0
    got = load_checkpoint(out)
    assert got["extra_state"]["train_iterator"] is None
    assert got["model"]["flat_param_0"].dtype == torch.float16
    assert got["last_optimizer_state"]["state"][0]["exp_avg"].dtype == torch.float32


def test_fp16_cast_that_would_make_inf_is_refused_and_writes_nothing(tmp_path: Path, capsys) -> None:
    model = make_model()
    model.params["decoder.layers.0.fc2.bias"][1] = 70000.0  # beyond float16's 65504
    model.params["decoder.layers.1.scale"][0] = float("inf")  # inf already: stays inf, not refused
    write_shards(make_shards(model, 2), tmp_path / "ckpts")
    out = tmp_path / "out" / "s{i}.pt"
    assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(out), "--num-output-shards", "3",
                 "--output-dtype", "fp16"]) == 2
    line = _error_line(capsys)
    assert "--output-dtype: 1 finite float32 value(s) up to 70000 would become inf in float16" in line, line
    assert "use --output-dtype bf16" in line and f"{tmp_path / 'out' / 's'}" in line
    assert not (tmp_path / "out").exists() or not _files(tmp_path / "out")
    assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(out), "--num-output-shards", "3",
                 "--output-dtype", "bf16"]) == 0
    model.params["decoder.layers.0.fc2.bias"][1] = 60000.0
    write_shards(make_shards(model, 2), tmp_path / "ckpts2")
    assert main(["--input", _pattern(tmp_path / "ckpts2"), "--output", str(tmp_path / "u.pt"), "--unflatten-weights",
                 "--output-dtype", "fp16"]) == 0
    got = load_checkpoint(tmp_path / "u.pt")["model"]
    assert got["decoder.layers.0.fc2.bias"][1] == 60000.0 and got["decoder.layers.1.scale"][0] == float("inf")


def test_a_bf16_cast_that_would_make_inf_is_refused_without_suggesting_bf16(tmp_path: Path, capsys) -> None:
    model = make_model()
    model.params["decoder.layers.0.fc2.bias"][1] = 3.4e38  # rounds up to bfloat16's inf
    write_shards(make_shards(model, 2), tmp_path / "ckpts")
    assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(tmp_path / "out" / "s{i}.pt"),
                 "--output-dtype", "bf16"]) == 2
    assert _error_line(capsys).endswith("1 finite float32 value(s) up to 3.4e+38 would become inf in bfloat16; keep "
                                        "the dtype")


def test_a_cast_of_nan_weights_passes_verify(tmp_path: Path) -> None:
    """torch casts one NaN to other bits in other chunks of a tensor (here: the writer's per output, --verify's
    per parameter): the tool writes the standard NaN of each sign, so --verify sees the bits it plans."""
    model = make_model(dtype=torch.float16, instances=(("", (("w", (21,)), ("b", (3,))), ()),))
    model.params["w"][:11], model.params["w"][11:] = float("nan"), -float("nan")
    write_shards(make_shards(model, 2), tmp_path / "ckpts")
    for out, dtype, flags in (("flat", "fp32", ["--num-output-shards", "3"]), ("one", "bf16", ["--unflatten-weights"])):
        assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(tmp_path / out / "s{i}.pt"),
                     "--output-dtype", dtype, "--verify", "--quiet", *flags]) == 0
    got = load_checkpoint(tmp_path / "one" / "s0.pt")["model"]["w"]
    assert got.dtype == torch.bfloat16 and got.isnan().all()
    assert set(got.view(torch.int16).tolist()) == {0x7FC0, 0xFFC0 - 0x10000}  # the sign kept


def test_verify_reads_back_outputs_that_hold_the_same_bytes(tmp_path: Path) -> None:
    """Outputs whose cfg names no rank and whose shards hold the same bytes (all NaN) are not taken for copies:
    this run wrote each."""
    model = make_model(instances=(("", (("w", (21,)), ("b", (3,))), ()),))
    model.params["w"][:] = float("nan")
    shards = make_shards(model, 2)
    for shard in shards:
        shard["cfg"] = {}
    write_shards(shards, tmp_path / "ckpts")
    assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(tmp_path / "out" / "s{i}.pt"),
                 "--num-output-shards", "3", "--verify", "--quiet"]) == 0
    flat = [load_checkpoint(tmp_path / "out" / f"s{i}.pt")["model"]["flat_param_0"].view(torch.int32) for i in (0, 1)]
    assert torch.equal(*flat) and flat[0].numel() == 8


def test_output_names_near_the_file_name_limit_are_written(shard_dir: Path, tmp_path: Path) -> None:
    """255 bytes is the limit of a file name; the temp file beside it (a pid and random letters longer) must fit."""
    name = "x" * 240 + "-shard{i}.pt"  # 250 characters once {i} is a digit
    assert main(["--input", _pattern(shard_dir), "--output", str(tmp_path / "out" / name), "--num-output-shards",
                 "2", "--quiet"]) == 0
    assert sorted(len(p.name) for p in (tmp_path / "out").iterdir()) == [250, 250]
    assert "shard_metadata" in load_checkpoint(tmp_path / "out" / name.format(i=1))


def test_model_part_placeholder_in_a_folder_named_with_brackets(tmp_path: Path) -> None:
    """`run[1]` is a name, not a character class, with or without '{j}' (every part)."""
    write_shards(make_shards(make_model(), 2), tmp_path / "run[1]")
    for part in ("0", "{j}"):
        out = tmp_path / f"out{len(part)}" / f"checkpoint_last-model_part-{part}-shard{{i}}.pt"
        assert main(["--input", str(tmp_path / "run[1]" / f"checkpoint_last-model_part-{part}-shard*.pt"),
                     "--output", str(out), "--num-output-shards", "3", "--quiet"]) == 0
        assert len(list(out.parent.iterdir())) == 3


def test_help_has_examples(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "examples:" in capsys.readouterr().out


def test_python_m_entry_point_runs(shard_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "single" / "reshard-model_part-0.pt"
    cmd = [sys.executable, "-m", "metaseq.scripts.reshard_fsdp", "--input", _pattern(shard_dir),
           "--output", str(out), "--unflatten-weights", "True", "--skip-optimizer-state", "True"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "found 4 input shard(s)" in proc.stderr and f"wrote {out}" in proc.stderr
    assert_tree_equal(load_checkpoint(out)["model"], make_model().state_dict())
    bad = subprocess.run(cmd[:3] + ["--input", str(tmp_path / "none*.pt"), "--output", "x.pt"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("ERROR: ") and len(bad.stderr.strip().splitlines()) == 1


def test_outputs_are_readable_like_any_new_file(shard_dir, tmp_path: Path) -> None:
    """Outputs get the permissions the umask gives (temp files not 0600), like `cp` or torch.save."""
    previous = os.umask(0o027)
    try:
        assert main(["--input", _pattern(shard_dir), "--output", str(tmp_path / "o{i}.pt"),
                     "--num-output-shards", "2", "--quiet"]) == 0
    finally:
        os.umask(previous)
    assert (tmp_path / "o1.pt").stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("name", ["o/s{i}.pt", "o/run7-s{i}.pt", "o/{i}/shard.pt"])
def test_outputs_read_back_in_order_whatever_their_name(shard_dir: Path, tmp_path: Path, name: str) -> None:
    """The tool reads back whatever it writes: the one number that differs between the names is the index."""
    argv = ["--input", _pattern(shard_dir), "--num-output-shards", "3", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / name)]) == 0
    back = str(tmp_path / name.replace("{i}", "*"))
    assert main(["--input", back, "--output", str(tmp_path / "back" / "s{i}.pt"), "--num-output-shards", "4",
                 "--quiet"]) == 0
    want = [load_checkpoint(p) for p in sorted(shard_dir.iterdir())]
    got = [load_checkpoint(tmp_path / "back" / f"s{r}.pt") for r in range(4)]
    assert_tree_equal([g["model"] for g in got], [w["model"] for w in want])


def test_output_name_with_digits_next_to_the_index_is_refused(shard_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["--input", _pattern(shard_dir), "--output", str(tmp_path / "s1{i}.pt"), "--num-output-shards", "12"]) == 2
    assert "digits next to '{i}'" in _error_line(capsys)
    assert not list(tmp_path.glob("s1*.pt"))


def test_objects_of_other_classes_are_carried_without_running_them(tmp_path: Path) -> None:
    """No --trust-checkpoint needed: the tool never loads such objects, it writes them back as they were."""
    shards = make_shards(make_model(), 2)
    shards[0]["extra_state"]["custom"] = Opaque(7)
    shards[0]["cfg"]["model"] = argparse.Namespace(decoder_layers=2, dropout=0.1)
    write_shards(shards, tmp_path / "ckpts")
    LOADS.clear()
    assert main(["--input", _pattern(tmp_path / "ckpts"), "--output", str(tmp_path / "o{i}.pt"),
                 "--num-output-shards", "3", "--quiet"]) == 0
    assert LOADS == []  # resharding ran no code of the class
    got = load_checkpoint(tmp_path / "o2.pt", trust=True)
    assert LOADS == [7] and got["extra_state"]["custom"].value == 7
    assert got["cfg"]["model"] == argparse.Namespace(decoder_layers=2, dropout=0.1)


def test_a_nan_step_on_every_rank_is_one_value_not_a_mismatch(tmp_path: Path) -> None:
    """Ranks' steps are compared (one rank's is written for all); NaN, equal to nothing, still equals itself here."""
    shards = make_shards(make_model(), 2)
    for shard in shards:
        for state in shard["last_optimizer_state"]["state"].values():
            state["step"] = float("nan")
    write_shards(shards, tmp_path / "in")
    out = tmp_path / "out" / "checkpoint_last-model_part-0-shard{i}.pt"
    assert main(["--input", str(tmp_path / "in" / "*.pt"), "--output", str(out), "--num-output-shards", "3",
                 "--quiet"]) == 0
    steps = load_checkpoint(str(out).format(i=2))["last_optimizer_state"]["state"][0]["step"]
    assert steps != steps


@pytest.mark.parametrize("tool", ["metaseq.scripts.compare_checkpoints", "metaseq.cli.train"])
def test_a_ctrl_c_while_a_tool_starts_is_one_line(tool: str) -> None:
    """These tools import torch (a second or more) before their main() runs: a Ctrl-C then is one line, status
    130, not an import's traceback (nor swallowed by torch's import); one after the tool is done changes nothing."""
    for delay in (0.5, 1.0, 1.6):
        proc = subprocess.Popen([sys.executable, "-m", tool, "--help"], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
        stopped = proc.returncode == 130 and len(err.splitlines()) == 1 and "ERROR" in err and "interrupted" in err
        assert stopped or (proc.returncode, err) == (0, ""), (delay, proc.returncode, err)
