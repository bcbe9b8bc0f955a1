"""`python -m metaseq.scripts.compare_checkpoints A B`: any sharding on either side, exit 0 only if equal."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metaseq.benchmark.measure import run_measured
from metaseq.reshard.compare import tensor_difference
from metaseq.scripts.compare_checkpoints import main
from metaseq.scripts.reshard_fsdp import main as reshard_main
from synthetic import make_model, make_shards, write_shards

REPO = Path(__file__).resolve().parents[1]
SHARD = "checkpoint_last-model_part-0-shard{}.pt"


def _glob(folder: Path) -> str:
    return str(folder / SHARD.format("*"))


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    write_shards(make_shards(make_model(), 4), tmp_path / "ckpts")
    return tmp_path / "ckpts"


def _reshard(src: Path, out: Path, *extra: str) -> None:
    assert reshard_main(["--input", _glob(src), "--output", str(out), "--quiet", *extra]) == 0


def _compare(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return rc, captured.out


def test_reshard_to_any_sharding_is_the_same_model(ckpts: Path, tmp_path: Path, capsys) -> None:
    _reshard(ckpts, tmp_path / "three" / SHARD.format("{i}"), "--num-output-shards", "3")
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "three"))
    assert rc == 0
    assert "A: 4 flat shards" in out and "B: 3 flat shards" in out
    assert "compared 12 model tensors, 16 optimizer tensors and 8 optimizer scalars" in out
    assert out.strip().endswith("SAME: the checkpoints hold the same model and optimizer state")


def test_flat_shards_against_unflattened_file(ckpts: Path, tmp_path: Path, capsys) -> None:
    _reshard(ckpts, tmp_path / "u.pt", "--unflatten-weights")
    rc, out = _compare(capsys, str(tmp_path / "u.pt"), _glob(ckpts))
    assert rc == 0 and "A: 1 unflattened file" in out and "SAME" in out


def test_changed_parameter_is_listed_with_its_max_abs_difference(ckpts: Path, tmp_path: Path, capsys) -> None:
    model = make_model()
    model.params["decoder.layers.0.fc2.bias"][1] += 0.5
    write_shards(make_shards(model, 2), tmp_path / "changed")
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "changed"))
    assert rc == 1
    differs = [line for line in out.splitlines() if line.startswith("differs: ")]
    assert "differs: decoder.layers.0.fc2.bias: max abs diff 0.5" in differs
    # make_shards derives the moments from the weights, so they moved too; nothing else did
    assert all("fc2.bias" in line for line in differs) and len(differs) == 3
    assert out.strip().endswith("DIFFERENT: 3 difference(s)")


def test_optimizer_difference_and_skip_optimizer_state(ckpts: Path, tmp_path: Path, capsys) -> None:
    shards = make_shards(make_model(), 4)
    shards[3]["last_optimizer_state"]["state"][1]["exp_avg_sq"][0] += 1.0  # element 30 of 38: fc2.weight
    shards[0]["last_optimizer_state"]["param_groups"][0]["lr"] = 5e-4
    write_shards(shards, tmp_path / "changed")
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "changed"))
    assert rc == 1
    assert "differs: optimizer exp_avg_sq of decoder.layers.0.fc2.weight: max abs diff 1" in out
    assert "differs: optimizer param_groups[0]['lr']: 0.001 vs 0.0005" in out  # the setting, not the whole list
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "changed"), "--skip-optimizer-state")
    assert rc == 0 and "compared 12 model tensors\n" in out


def test_an_optimizer_setting_of_one_rank_only_is_a_difference_and_a_reshard_warns(ckpts: Path, tmp_path: Path,
                                                                                     capsys) -> None:
    """Every rank resumes with its own settings: a file whose lr differs from shard 0's is not its reshard (which
    gives every output shard 0's), and resharding it says so."""
    shards = make_shards(make_model(), 4)
    shards[2]["last_optimizer_state"]["param_groups"][0]["lr"] = 5e-4
    write_shards(shards, tmp_path / "changed")
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "changed"))
    shard = lambda i: tmp_path / "changed" / SHARD.format(i)  # noqa: E731
    assert rc == 1 and f"differs: optimizer param_groups[0]['lr'] ({shard(2)}'s, unlike {shard(0)}'s): only in B" in out
    assert reshard_main(["--input", _glob(tmp_path / "changed"), "--output", str(tmp_path / "r.pt")]) == 0
    assert (f"{shard(2)}: last_optimizer_state.param_groups[0]['lr'] differs from {shard(0)}'s (0.0005 vs 0.001)"
            in capsys.readouterr().err)
    assert _compare(capsys, _glob(tmp_path / "changed"), _glob(tmp_path / "changed"))[0] == 0
    shards[2]["last_optimizer_state"]["param_groups"][0]["lr"] = 1e-3  # as the others
    for r, scale in enumerate((128.0, 128.0, 64.0, 128.0)):  # a tensor setting: told apart by its value
        shards[r]["last_optimizer_state"]["loss_scale"] = torch.tensor(scale)
    write_shards(shards, tmp_path / "scaled")
    assert reshard_main(["--input", _glob(tmp_path / "scaled"), "--output", str(tmp_path / "s.pt")]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'scaled' / SHARD.format(2)}: last_optimizer_state.loss_scale differs" in err


def test_a_buffer_copy_of_one_rank_only_is_a_difference(ckpts: Path, tmp_path: Path, capsys) -> None:
    shards = make_shards(make_model(), 4)
    shards[1]["model"]["decoder.version"] += 1  # every rank saves the buffer whole; a reshard keeps shard 0's
    write_shards(shards, tmp_path / "changed")
    rc, out = _compare(capsys, _glob(ckpts), _glob(tmp_path / "changed"))
    shard = lambda i: tmp_path / "changed" / SHARD.format(i)  # noqa: E731
    assert rc == 1 and f"differs: decoder.version ({shard(1)}'s copy, unlike {shard(0)}'s): only in B" in out, out
    assert "note: cfg, optimizer_history (update count, LR scheduler) and extra_state but EMA" in out  # what is not
    assert _compare(capsys, _glob(tmp_path / "changed"), _glob(tmp_path / "changed"))[0] == 0


def test_optimizer_state_on_one_side_only_is_a_note(ckpts: Path, tmp_path: Path, capsys) -> None:
    _reshard(ckpts, tmp_path / "weights.pt", "--unflatten-weights", "--skip-optimizer-state")
    rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / "weights.pt"))
    assert rc == 0 and "note: optimizer state only in A; not compared" in out
    assert out.strip().endswith("SAME: the checkpoints hold the same model")


def test_atol_and_dtype(ckpts: Path, tmp_path: Path, capsys) -> None:
    _reshard(ckpts, tmp_path / "half.pt", "--unflatten-weights", "--output-dtype", "fp16")
    rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / "half.pt"))
    assert rc == 1 and "some tensors are float32 in A and float16 in B" in out
    rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / "half.pt"), "--atol", "1e-2")
    assert rc == 0


def test_plain_state_dicts_from_other_tools(ckpts: Path, tmp_path: Path, capsys) -> None:
    state_dict = make_model().state_dict()
    torch.save({"model": state_dict}, tmp_path / "wrapped.pt")
    torch.save(state_dict, tmp_path / "bare.pt")
    for name in ("wrapped.pt", "bare.pt"):
        rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / name), "--skip-optimizer-state")
        assert rc == 0 and "a plain state dict" in out, out
    torch.save({"model": state_dict, "last_optimizer_state": {"state": {0: {}}}}, tmp_path / "with_optim.pt")
    rc, out = _compare(capsys, str(tmp_path / "with_optim.pt"), str(tmp_path / "bare.pt"))
    assert rc == 0 and "with_optim.pt has no shard_metadata, so its optimizer state ids cannot be matched" in out
    del state_dict["decoder.layers.1.scale"]
    state_dict["decoder.layer_norm.bias"] = torch.zeros(4)
    torch.save(state_dict, tmp_path / "other.pt")
    rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / "other.pt"))
    assert rc == 1
    assert "differs: decoder.layers.1.scale: only in A" in out
    assert "differs: decoder.layer_norm.bias: shape [3] vs [4]" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["NONE", "CKPTS"], "none*.pt' matches no files"),
        (["CKPTS", "CKPTS", "--atol", "-1"], "--atol=-1.0: must be a number at least 0"),
        (["CKPTS", "CKPTS", "--atol", "nan"], "--atol=nan: must be a number at least 0"),
        (["PARTS", "CKPTS"], "A: model_part-1 is missing: pattern 'PARTS' matches parts [0, 2]"),  # all parts merged
        (["CKPTS"], "the following arguments are required: B"),
        (["CKPTS", "GARBAGE"], "garbage.pt: cannot read checkpoint"),
        (["NOMETA", "CKPTS"], "nometa.pt: no 'shard_metadata'; it has flat_param_* keys"),
        (["CKPTS", "NOTENSORS"], "notensors.pt: neither FSDP shards nor a state dict (no 'model' dict of tensors)"),
        (["NOTENSORS2", "NOTENSORS2"], "nothing.pt: neither FSDP shards nor a state dict (no 'model' dict of tensors)"),
        (["VIEW", "CKPTS"], "view.pt: model['w'] is a non-contiguous view; cannot compare it"),
        (["CKPTS", "FOLDER"], "B: pattern 'FOLDER' matches no files; it is a folder: name a checkpoint in it, e.g. "
                              "FOLDER/nometa.pt"),
    ],
)
def test_errors_are_one_line_with_exit_2(ckpts: Path, tmp_path: Path, capsys, argv: list[str], words: str) -> None:
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x02junk")
    torch.save({"model": make_shards(make_model(), 1)[0]["model"]}, tmp_path / "nometa.pt")
    torch.save({"step": 3}, tmp_path / "notensors.pt")
    torch.save({"model": {"x": 1}}, tmp_path / "nothing.pt")  # compared with itself it was SAME, of 0 tensors
    torch.save({"model": {"w": torch.zeros(3, 4).t()}}, tmp_path / "view.pt")
    names = {"NONE": str(tmp_path / "none*.pt"), "CKPTS": _glob(ckpts), "GARBAGE": str(tmp_path / "garbage.pt"),
             "NOMETA": str(tmp_path / "nometa.pt"), "NOTENSORS": str(tmp_path / "notensors.pt"),
             "VIEW": str(tmp_path / "view.pt"), "NOTENSORS2": str(tmp_path / "nothing.pt")}
    (tmp_path / "folder").mkdir()
    torch.save({"model": {}}, tmp_path / "folder" / "nometa.pt")
    names["FOLDER"] = str(tmp_path / "folder")
    (tmp_path / "parts").mkdir()
    for j in (0, 2):
        (tmp_path / "parts" / f"checkpoint_last-model_part-{j}-shard0.pt").write_bytes(b"")
    names["PARTS"] = str(tmp_path / "parts" / "*.pt")
    assert main([names.get(a, a) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    words = words.replace("FOLDER", names["FOLDER"]).replace("PARTS", names["PARTS"])
    assert captured.err.count("\n") == 1 and captured.err.startswith("ERROR: ") and words in captured.err


def test_memory_is_about_one_parameter_per_side_not_the_model(tmp_path: Path) -> None:
    """8 parameters of 16 MiB per side: comparing holds one pair at a time, not 256 MiB of model."""
    big = (("", tuple((f"decoder.w{i}", (1024, 4096)) for i in range(8)), ()),)
    write_shards(make_shards(make_model(instances=big, buffers={}), 2, optimizer=False), tmp_path / "ckpts")
    _reshard(tmp_path / "ckpts", tmp_path / "u.pt", "--unflatten-weights")
    base = run_measured([sys.executable, "-c", "import metaseq.scripts.compare_checkpoints"], interval=0.01)
    run = run_measured([sys.executable, "-m", "metaseq.scripts.compare_checkpoints", _glob(tmp_path / "ckpts"),
                        str(tmp_path / "u.pt")], interval=0.01)
    assert run.returncode == 0, run.stderr_tail
    assert run.peak_anon - base.peak_anon < 96 << 20, (run.peak_anon >> 20, base.peak_anon >> 20)


@pytest.mark.parametrize(
    "x, y, exact, expected",
    [
        ([float("nan"), 1.0], [float("nan"), 1.0], False, None),
        ([float("inf")], [float("inf")], True, None),
        ([0.0], [-0.0], False, None),
        ([0.0], [-0.0], True, "max abs diff 0 (same values, different bits)"),
        ([1.0, 2.0], [1.0, 2.25], False, "max abs diff 0.25"),
        ([1.0], [float("nan")], False, "max abs diff nan"),
    ],
)
def test_tensor_difference(x: list[float], y: list[float], exact: bool, expected: str | None) -> None:
    assert tensor_difference(torch.tensor(x), torch.tensor(y), exact_dtype=exact) == expected


def test_integers_beyond_float64_and_empty_tensors_of_two_dtypes(tmp_path: Path, capsys) -> None:
    """Integers are compared exactly (float64 has 53 bits: 2**53 + 1 reads as 2**53); empty tensors are equal
    whatever their dtypes."""
    def save(name: str, count: int, empty_dtype: torch.dtype) -> str:
        model = {"count": torch.tensor([2**53 + count, -2**63]), "empty": torch.zeros(0, 3, dtype=empty_dtype)}
        torch.save({"model": model}, tmp_path / name)
        return str(tmp_path / name)

    rc, out = _compare(capsys, save("a.pt", 0, torch.float32), save("b.pt", 1, torch.float16))
    assert rc == 1 and "differs: count: max abs diff 1\n" in out and "DIFFERENT: 1 difference(s)" in out, out
    rc, out = _compare(capsys, save("a.pt", 0, torch.float32), save("b.pt", 0, torch.float16))
    assert rc == 0 and "some tensors are float32 in A and float16 in B" in out, out
    assert tensor_difference(torch.tensor([-2**63]), torch.tensor([2**63 - 1])) == "max abs diff 1.84467e+19"


def test_python_m_entry_point(ckpts: Path, tmp_path: Path) -> None:
    _reshard(ckpts, tmp_path / "u.pt", "--unflatten-weights", "--skip-optimizer-state")
    cmd = [sys.executable, "-m", "metaseq.scripts.compare_checkpoints", _glob(ckpts), str(tmp_path / "u.pt"), "--quiet"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "SAME: the checkpoints hold the same model"


def test_tied_copy_stored_in_an_unflattened_file_is_compared_on_its_own(ckpts: Path, tmp_path: Path, capsys) -> None:
    _reshard(ckpts, tmp_path / "u.pt", "--unflatten-weights", "--skip-optimizer-state")
    ckpt = torch.load(tmp_path / "u.pt", weights_only=True)
    ckpt["model"]["decoder.output_projection.weight"] = ckpt["model"]["decoder.embed_tokens.weight"] + 2.0  # untied
    torch.save(ckpt, tmp_path / "untied.pt")
    rc, out = _compare(capsys, _glob(ckpts), str(tmp_path / "untied.pt"), "--skip-optimizer-state")
    assert rc == 1
    assert [line for line in out.splitlines() if line.startswith("differs")] == [
        "differs: decoder.output_projection.weight: max abs diff 2"
    ]


class Schedule:
    """A class the reader does not know: carried, compared by its pickle."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup


def test_a_checkpoint_is_the_same_as_itself_whatever_its_optimizer_settings_hold(ckpts: Path, tmp_path: Path,
                                                                                 capsys) -> None:
    """NaN settings, carried objects, globals and dicts keyed by frozensets equal themselves."""
    _reshard(ckpts, tmp_path / "u.pt", "--unflatten-weights")
    ckpt = torch.load(tmp_path / "u.pt", weights_only=False)
    for group in ckpt["last_optimizer_state"]["param_groups"]:
        group.update(nan=float("nan"), kind=int, schedule=Schedule(10), by_set={frozenset({1}): 2})
    ckpt["last_optimizer_state"]["loss_scale"] = torch.tensor([float("nan"), 2.0])
    torch.save(ckpt, tmp_path / "odd.pt")
    rc, out = _compare(capsys, str(tmp_path / "odd.pt"), str(tmp_path / "odd.pt"))
    assert rc == 0 and out.strip().endswith("SAME: the checkpoints hold the same model and optimizer state"), out
    for group in ckpt["last_optimizer_state"]["param_groups"]:
        group.update(schedule=Schedule(11))
    torch.save(ckpt, tmp_path / "other.pt")
    rc, out = _compare(capsys, str(tmp_path / "odd.pt"), str(tmp_path / "other.pt"))
    assert rc == 1 and "differs: optimizer " in out, out
