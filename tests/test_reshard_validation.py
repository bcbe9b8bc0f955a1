"""Every bad input or option: exit 2, one ERROR line naming the culprit, nothing written.

Each case builds 4 synthetic shards (or other files) in tmp_path/ckpts, spoils them,
runs `main([...])` and checks that no file under tmp_path was added or changed.
"""
from __future__ import annotations

import collections
import hashlib
import re
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from metaseq.checkpoint_utils import RestoreError, read_restore_files
from metaseq.file_io import load_checkpoint
from metaseq.scripts.reshard_fsdp import main
from synthetic import Opaque, make_model, make_shards, write_shards

Spoil = Callable[[list[dict[str, Any]]], None]
SHARD = "checkpoint_last-model_part-0-shard{}.pt"


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under folder (hidden ones too) -> sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _fails(tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run main, assert exit 2, one ERROR line at the end, no traceback and nothing written; the line."""
    before = _snapshot(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ERROR: ")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert _snapshot(tmp_path) == before, "a failed run wrote or changed files"
    assert not (tmp_path / "out").exists()
    return errors[0]


def _write(tmp_path: Path, spoil: Spoil | None = None, world_size: int = 4) -> str:
    shards = make_shards(make_model(), world_size)
    if spoil is not None:
        spoil(shards)
    write_shards(shards, tmp_path / "ckpts")
    return str(tmp_path / "ckpts" / SHARD.format("*"))


def _args(pattern: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["--input", pattern, "--output", str(tmp_path / "out" / "shard{i}.pt"), *extra]


def _meta(shard: dict[str, Any], instance: int) -> dict[str, Any]:
    return shard["shard_metadata"]["param_metadata"][instance]["params"]["flat_param_0"]


# --- which files ---------------------------------------------------------------------------------


def test_glob_matching_nothing(tmp_path: Path, capsys) -> None:
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "nope-shard*.pt"), tmp_path))
    assert "--input-glob-pattern" in line and "nope-shard*.pt" in line and "matches no files" in line
    _write(tmp_path)
    folder = tmp_path / "ckpts"
    line = _fails(tmp_path, capsys, _args(str(folder), tmp_path))
    assert f"'{folder}' matches no files; it is a folder: name a checkpoint in it, e.g. '{folder / SHARD.format('*')}'" in line
    line = _fails(tmp_path, capsys, _args(str(tmp_path), tmp_path))
    assert line.endswith(f"'{tmp_path}' matches no files; it is a folder without .pt files")
    stem = folder / "checkpoint_last.pt"  # the save's name, as training and inference take it
    line = _fails(tmp_path, capsys, _args(str(stem), tmp_path))
    assert line.endswith(f"'{stem}' matches no files; it names a save, not its files: pass the shard files, e.g. "
                         f"'{folder / SHARD.format('*')}'")


def test_files_from_two_model_parts(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    write_shards(make_shards(make_model(), 4), tmp_path / "ckpts", part=1)
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "ckpts" / "*.pt"), tmp_path))
    assert "model parts [0, 1]" in line and "name one model part's files" in line and "'{j}' in both names" in line


def test_missing_shard_index(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "ckpts" / SHARD.format(1)).unlink()
    assert "shard1 is missing" in _fails(tmp_path, capsys, _args(pattern, tmp_path))


def test_missing_last_shard_is_named_from_the_files_cfg(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "ckpts" / SHARD.format(3)).unlink()  # shards 0..2 alone look like a set of 3, but hold too little
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert "shard_metadata numels add up to" in line and "are the shards complete" not in line
    assert line.endswith("; their cfg says the save had 4 shards per model part, so shard(s) 3 seem to be missing (a "
                         "rank that failed to save, or a copy cut short?): use every file of one complete save")


def test_broken_link_among_the_shards(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "ckpts" / SHARD.format(3)).unlink()
    (tmp_path / "ckpts" / SHARD.format(3)).symlink_to(tmp_path / "elsewhere.pt")
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert line == (f"ERROR: {tmp_path / 'ckpts' / SHARD.format(3)} is a broken symbolic link (to "
                    f"{tmp_path / 'elsewhere.pt'}, which does not exist); restore that file, or remove the link")


def test_duplicate_shard_index(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "ckpts" / SHARD.format("02")).write_bytes((tmp_path / "ckpts" / SHARD.format(2)).read_bytes())
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert "shard index 2 appears twice" in line and SHARD.format("02") in line
    assert line.endswith("; --input-glob-pattern matches two checkpoints (or a copy): make it match one")


def _swap(folder: Path, a: int, b: int) -> None:
    (folder / SHARD.format(a)).rename(folder / "tmp")
    (folder / SHARD.format(b)).rename(folder / SHARD.format(a))
    (folder / "tmp").rename(folder / SHARD.format(b))


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda folder: _swap(folder, 0, 1),  # the same lengths: only their cfg tells
         f"{SHARD.format(0)} was saved by rank 1 (its cfg's distributed_rank) but its name says rank 0: the files "
         "were renamed or swapped; give them back the names training wrote"),
        (lambda folder: _swap(folder, 2, 3),  # the padded shard before a full one: not FSDP's split
         f"{SHARD.format(2)}: holds 6 elements of flat parameter 'flat_param_0' but FSDP gives shard 2 of 4 7: the "
         "files are not in the order of the ranks that saved them (renamed?); each shardK must be rank K's file"),
        (lambda folder: (folder / SHARD.format(2)).write_bytes((folder / SHARD.format(1)).read_bytes()),
         f"{SHARD.format(2)} and FOLDER/{SHARD.format(1)} were both saved by rank 1 (their cfg's distributed_rank): "
         "one is a copy of the other; use the files of one save"),
    ],
    ids=["swapped", "swapped-padding", "copied"],
)
def test_shard_files_not_in_the_order_of_their_ranks(tmp_path: Path, capsys, spoil: Callable, words: str) -> None:
    """Read in another order, the shards would make a wrong model without any other error."""
    pattern = _write(tmp_path)
    spoil(tmp_path / "ckpts")
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert words.replace("FOLDER", str(tmp_path / "ckpts")) in line, line


def test_a_copied_shard_is_refused_by_its_bytes_where_no_file_says_its_rank(tmp_path: Path, capsys) -> None:
    """Older resharded files (and upstream's) all say rank 0: different shards go through, but a shard copied over
    another is refused, by the reshard tool and by training's restore alike."""
    def unranked(shards: list[dict[str, Any]]) -> None:
        for shard in shards:
            shard["cfg"]["distributed_training"]["distributed_rank"] = 0
            shard["extra_state"]["train_iterator"]["iterations_in_epoch"] = 7

    pattern = _write(tmp_path, unranked)
    assert main(["--input", pattern, "--output", str(tmp_path / "fine" / "s{i}.pt"), "--num-output-shards", "2",
                 "--quiet"]) == 0
    folder = tmp_path / "ckpts"
    (folder / SHARD.format(2)).write_bytes((folder / SHARD.format(1)).read_bytes())  # neither holds padding
    copied = f"{folder / SHARD.format(2)} and {folder / SHARD.format(1)} hold the same bytes (their cfg does not say"
    assert copied in _fails(tmp_path, capsys, _args(pattern, tmp_path))
    with pytest.raises(RestoreError, match=re.escape(copied)):
        read_restore_files(str(folder / "checkpoint_last.pt"), 4)


def test_file_without_shard_index_among_several(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    torch.save({"model": {}}, tmp_path / "ckpts" / "checkpoint_last-model_part-0-extra.pt")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "ckpts" / "*.pt"), tmp_path))
    assert "checkpoint_last-model_part-0-extra.pt: no shard index" in line


def test_stray_file_of_no_model_part_is_named(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    torch.save({"model": {}}, tmp_path / "ckpts" / "checkpoint_last.pt")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "ckpts" / "checkpoint_last*.pt"), tmp_path))
    assert "checkpoint_last.pt: not a model part's shard like" in line and "narrow --input-glob-pattern" in line


# --- not an FSDP shard ---------------------------------------------------------------------------


def test_consolidated_file_is_called_consolidated(tmp_path: Path, capsys) -> None:
    torch.save({"model": make_model().state_dict()}, tmp_path / "consolidated.pt")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "consolidated.pt"), tmp_path))
    assert "consolidated.pt: no 'shard_metadata'" in line and "looks consolidated" in line


def test_shard_saved_without_metadata_is_called_not_from_fsdp(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path, lambda shards: shards[2].pop("shard_metadata"))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert f"{SHARD.format(2)}: no 'shard_metadata'" in line and "local_metadata_dict" in line


@pytest.mark.parametrize(
    "content, message",
    [({"weights": [1, 2]}, "no 'model' dict"), (torch.zeros(3), "expected a dict checkpoint, found Tensor")],
)
def test_file_that_is_not_a_metaseq_checkpoint(tmp_path: Path, capsys, content: Any, message: str) -> None:
    torch.save(content, tmp_path / "other.pt")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "other.pt"), tmp_path))
    assert "other.pt" in line and message in line


# --- metadata that disagrees ---------------------------------------------------------------------


def _drop_instance(shards: list[dict[str, Any]]) -> None:
    shards[2]["shard_metadata"]["param_metadata"].pop()


def _rename(shards: list[dict[str, Any]]) -> None:
    _meta(shards[2], 1)["names"][0] = "fc9.weight"


def _transpose(shards: list[dict[str, Any]]) -> None:
    _meta(shards[2], 0)["shapes"][0] = torch.Size([3, 7])


def _bad_numel(shards: list[dict[str, Any]]) -> None:
    _meta(shards[3], 2)["numels"][0] = 4


def _untied_flat_key(shards: list[dict[str, Any]]) -> None:
    shards[1]["model"]["_fsdp_wrapped_module.flat_param_0"] = shards[1]["model"]["flat_param_0"]


def _one_flat_key_as_names(shards: list[dict[str, Any]]) -> None:
    """Layer 1's flat parameter stored under its original name, while the others keep their flat keys."""
    model = shards[2]["model"]
    model["decoder.layers.1.scale"] = model.pop("decoder.layers.1.flat_param_0")


def _tie_to_nothing(shards: list[dict[str, Any]]) -> None:
    for shard in shards:
        shard["shard_metadata"]["param_metadata"][0]["shared_param_info"] = [("nope.weight", "decoder.foo.weight")]


@pytest.mark.parametrize(
    "spoil, culprit, words",
    [
        (_drop_instance, 2, "lists 2 flat parameters but"),
        (_rename, 2, "disagrees with"),
        (_transpose, 2, "on the shapes of flat parameter 'flat_param_0'"),
        (_bad_numel, 3, "'decoder.layers.1.scale' has shape [3] but numel 4"),
        (lambda s: s[1].__setitem__("shard_metadata", {"buffer_names": []}), 1, "has no 'param_metadata' list"),
        (lambda s: _meta(s[1], 0).pop("names"), 1, "malformed shard_metadata (KeyError: 'names')"),
        (lambda s: _meta(s[0], 0)["names"].append("x.weight"), 0, "'flat_param_0' has 4 names, 3 shapes, 3 numels"),
        (_tie_to_nothing, 0, "ties 'decoder.foo.weight' to 'nope.weight', which no flat parameter holds"),
        (_untied_flat_key, 1, "keys 'flat_param_0' and '_fsdp_wrapped_module.flat_param_0' both mean 'flat_param_0'"),
        (lambda s: s[2]["model"].pop("decoder.layers.0.flat_param_0"), 2,
         "model has no 'decoder.layers.0.flat_param_0' (nor original parameter names such as 'decoder.layers.0.fc1"),
        (_one_flat_key_as_names, 2,
         "model has no 'decoder.layers.1.flat_param_0' (nor original parameter names such as 'decoder.embed_tokens"),
    ],
)
def test_metadata_malformed_or_disagreeing_across_shards(tmp_path, capsys, spoil: Spoil, culprit: int,
                                                         words: str) -> None:
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, spoil), tmp_path))
    assert SHARD.format(culprit) in line and words in line


def _seed(shards: list[dict[str, Any]], rank: int, seed: int) -> None:
    shards[rank]["cfg"]["common"] = {"seed": seed}


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda s: s[2]["optimizer_history"][-1].__setitem__("num_updates", 40),
         f"{SHARD.format(2)} was saved at update 40 but "),
        (lambda s: [_seed(s, r, 9 if r == 3 else 1) for r in range(4)],
         f"{SHARD.format(3)} comes from a run with seed 9 but "),
        (lambda s: [s[r]["extra_state"].__setitem__("run_id", "b" if r == 1 else "a") for r in range(4)],
         f"{SHARD.format(1)} comes from training run b but "),
    ],
)
def test_shards_of_different_saves_are_refused(tmp_path, capsys, spoil: Spoil, words: str) -> None:
    """A set mixed from two saves (one cut short, or another run's file copied in) is one model at no update."""
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, spoil), tmp_path))
    assert words in line and SHARD.format(0) in line
    assert "use the files of one complete save" in line or "use one run's files" in line


# --- flat tensors that disagree with their metadata ----------------------------------------------


def _short_tensor(shards: list[dict[str, Any]]) -> None:
    key = "decoder.layers.0.flat_param_0"
    shards[3]["model"][key] = shards[3]["model"][key][:-1].clone()


def _wrong_padding(shards: list[dict[str, Any]]) -> None:
    _meta(shards[1], 1)["padding"] += 1


def _impossible_padding(shards: list[dict[str, Any]]) -> None:
    _meta(shards[0], 0)["padding"] = 999


def _two_dim_flat(shards: list[dict[str, Any]]) -> None:
    shards[1]["model"]["flat_param_0"] = shards[1]["model"]["flat_param_0"].reshape(1, -1)


@pytest.mark.parametrize(
    "spoil, words",
    [
        (_short_tensor, f"{SHARD.format(3)}: flat parameter 'decoder.layers.0.flat_param_0' has 9 elements but"),
        (_wrong_padding, f"{SHARD.format(1)}: flat parameter 'decoder.layers.0.flat_param_0': the shards hold 37 elements"),
        (_impossible_padding, f"{SHARD.format(0)}: padding 999 of 'flat_param_0'"),
        (_two_dim_flat, f"{SHARD.format(1)}: model['flat_param_0'] should be a 1-D flat tensor"),
        (lambda s: s[2]["model"].__setitem__("flat_param_0", s[2]["model"]["flat_param_0"].half()),  # was cast
         f"{SHARD.format(2)}: model['flat_param_0'] is torch.float16 but "),
        (lambda s: _osd(s[1])["state"][0].__setitem__("exp_avg", _osd(s[1])["state"][0]["exp_avg"].double()),
         "['exp_avg'] is torch.float64 but "),
    ],
)
def test_flat_tensor_disagreeing_with_metadata_and_padding(tmp_path, capsys, spoil: Spoil, words: str) -> None:
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, spoil), tmp_path))
    assert words in line


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a storage twice as long."""
    return torch.stack([tensor, tensor], dim=-1)[..., 0]


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda s: s[1]["model"].__setitem__("flat_param_0", _strided(s[1]["model"]["flat_param_0"])),
         f"{SHARD.format(1)}: model.flat_param_0 is a view of another tensor's storage"),
        (lambda s: _osd(s[2])["state"][1].__setitem__("exp_avg", _strided(_osd(s[2])["state"][1]["exp_avg"])),
         f"{SHARD.format(2)}: last_optimizer_state.state.1.exp_avg is a view of another tensor's storage"),
        (lambda s: [r["model"].__setitem__("decoder.layers.0.position_ids", _strided(r["model"]["decoder.layers.0.position_ids"]))
                    for r in s], f"{SHARD.format(0)}: model.decoder.layers.0.position_ids is a view"),
    ],
)
def test_tensor_that_is_a_strided_view_is_refused(tmp_path, capsys, spoil: Spoil, words: str) -> None:
    assert words in _fails(tmp_path, capsys, _args(_write(tmp_path, spoil), tmp_path, "--num-output-shards", "3"))


# --- optimizer state that does not match the flat parameters -------------------------------------


def _osd(shard: dict[str, Any]) -> dict[str, Any]:
    return shard["last_optimizer_state"]


def _optimizer_without_instance_1(shard: dict[str, Any]) -> None:
    """As saved by an optimizer given only the other instances' parameters (instance 1 frozen)."""
    osd = _osd(shard)
    osd["state"] = {0: osd["state"][0], 1: osd["state"][2]}
    osd["param_groups"][0]["params"] = [0, 1]


def _optimizer_given_groups_out_of_order(shard: dict[str, Any]) -> None:
    """As saved by an optimizer given instance 1's parameters first, in a group of their own."""
    osd = _osd(shard)
    osd["state"] = {0: osd["state"][1], 1: osd["state"][0], 2: osd["state"][2]}
    osd["param_groups"] = [{**osd["param_groups"][0], "params": [0]}, {**osd["param_groups"][0], "params": [1, 2]}]


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda s: _osd(s[1])["state"].pop(2), f"{SHARD.format(1)}: last_optimizer_state covers flat parameters [0, 1]"),
        (lambda s: [_optimizer_given_groups_out_of_order(r) for r in s],
         "state id k is the k-th parameter the optimizer was given: do its 2 param groups list them in another order "
         "than the model's?); pass --skip-optimizer-state"),
        (lambda s: [_osd(r)["state"].__setitem__(7, {}) for r in s], "has id 7 but shard_metadata lists 3"),
        (lambda s: _osd(s[2])["state"][1].pop("exp_avg_sq"),
         f"{SHARD.format(2)}: last_optimizer_state.state[1] lacks 'exp_avg_sq'"),
        (lambda s: _osd(s[3])["state"][0].__setitem__("exp_avg", torch.zeros(5)),
         "state[0]['exp_avg'] has shape [5] but flat parameter 'flat_param_0' has 7 elements"),
        (lambda s: s[0].__setitem__("last_optimizer_state", {"momentum": 1}), "pass --skip-optimizer-state"),
        (lambda s: [_osd(r).__setitem__("param_id_map", {0: 0}) for r in s],
         f"{SHARD.format(0)}: holds consolidated optimizer state (param_id_map) but is one of several shards"),
        (lambda s: _osd(s[1])["state"][2].__setitem__("step", torch.tensor(99.0)),  # rank 0's was written for all
         f"{SHARD.format(1)}: last_optimizer_state.state[2]['step'] is 99.0 but "),
        (lambda s: s[2].__setitem__("last_optimizer_state", None),
         f"{SHARD.format(2)}: no last_optimizer_state, which "),
        (lambda s: s[0].pop("last_optimizer_state"),  # not read as a set without optimizer state
         f"{SHARD.format(0)}: no last_optimizer_state, which "),
        (lambda s: [_optimizer_without_instance_1(r) for r in s],  # read as flat parameters 0 and 1: wrong moments
         f"{SHARD.format(0)}: last_optimizer_state.param_groups hold 2 parameters but shard_metadata lists 3 flat "
         "parameters: the optimizer was given some of them (frozen ones left out?), and which is not saved; pass "
         "--skip-optimizer-state"),
    ],
)
def test_optimizer_state_not_matching_flat_parameters(tmp_path, capsys, spoil: Spoil, words: str) -> None:
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, spoil), tmp_path))
    assert words in line


def _consolidated_osd(shard: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state of an unflattened file: one entry per original parameter, by its global id."""
    assert set(shard["last_optimizer_state"]["param_id_map"]) == set(range(8))
    return shard["last_optimizer_state"]


@pytest.mark.parametrize(
    "spoil, words",
    [
        (lambda c: _consolidated_osd(c).__setitem__("uncollected_local_ids", [3]),
         "last_optimizer_state has uncollected_local_ids (no_broadcast_optim_state); not supported"),
        (lambda c: _consolidated_osd(c)["param_id_map"].__setitem__(0, 2),
         "param_id_map maps parameter 0 to flat parameter 2, expected 0"),
        (lambda c: _consolidated_osd(c)["state"].__setitem__(99, {}), "state has id 99 but shard_metadata lists 8"),
        (lambda c: _consolidated_osd(c)["state"].pop(1), "state lacks parameters [1] of flat parameter 'flat_param_0'"),
        (lambda c: _consolidated_osd(c)["state"][0].__setitem__("exp_avg", torch.zeros(2)),
         "state[0]['exp_avg'] has shape [2] but parameter 'decoder.embed_tokens.weight' has shape [7, 3]"),
        # Each would be lost silently: one step and one dtype per flat parameter are written.
        (lambda c: _consolidated_osd(c)["state"][1].__setitem__("step", 9.0),
         "state[1]['step'] is 9.0 but state[0]['step'] is 10; both are of flat parameter 'flat_param_0'"),
        (lambda c: _consolidated_osd(c)["state"][2].__setitem__("exp_avg", _consolidated_osd(c)["state"][2]["exp_avg"]
                                                                .double()),
         "state[2]['exp_avg'] is torch.float64 but state[0]'s is torch.float32"),
        (lambda c: c["model"].__setitem__("decoder.layer_norm.bias", c["model"]["decoder.layer_norm.bias"].half()),
         "model['decoder.layer_norm.bias'] is torch.float16 but model['decoder.embed_tokens.weight'] is torch.float32"),
    ],
)
def test_consolidated_optimizer_state_not_matching_the_parameters(tmp_path, capsys, spoil, words: str) -> None:
    path = tmp_path / "consolidated.pt"
    assert main(["--input", _write(tmp_path), "--output", str(path), "--unflatten-weights", "--quiet"]) == 0
    consolidated = torch.load(path, weights_only=False)
    spoil(consolidated)
    torch.save(consolidated, path)
    line = _fails(tmp_path, capsys, _args(str(path), tmp_path, "--num-output-shards", "2"))
    assert line.startswith(f"ERROR: {path}: ") and words in line


# --- unreadable files ----------------------------------------------------------------------------


def test_truncated_file(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    path = tmp_path / "ckpts" / SHARD.format(2)
    path.write_bytes(path.read_bytes()[:-100])
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert f"{path}: corrupt checkpoint" in line and "truncated" in line and "restore the file" in line


def test_corrupt_metadata_is_caught_by_its_crc(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    path = tmp_path / "ckpts" / SHARD.format(1)
    data = bytearray(path.read_bytes())
    data[data.index(b"CrossEntropyCriterion")] ^= 0x20  # still unpickles, as "crossEntropyCriterion"
    path.write_bytes(bytes(data))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert f"{path}: corrupt checkpoint (record data.pkl fails its CRC32 check)" in line


def test_garbage_file(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    (tmp_path / "ckpts" / SHARD.format(3)).write_bytes(b"\x80\x02not a checkpoint at all")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "ckpts" / SHARD.format("*")), tmp_path, "--num-output-shards", "2"))
    assert f"{SHARD.format(3)}: cannot read checkpoint" in line and "not a torch checkpoint" in line
    assert len(line) < 300


class _Reduce:
    """Pickled as `fn(*args)`: a tensor rebuild call as a damaged or hand-made pickle may hold it."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _carrying(value: Any) -> Spoil:
    return lambda shards: shards[0]["extra_state"].__setitem__("x", value)


def _rewrite_zip(path: Path, change: Callable[[str, bytes], bytes]) -> None:
    """Rewrite a torch zip file record by record (so with new CRC32s), each record's bytes through `change`."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, change(name, data))


def _float_storage() -> torch.storage.TypedStorage:
    return torch.storage.TypedStorage(wrap_storage=torch.arange(6.0).untyped_storage(), dtype=torch.float32,
                                      _internal=True)


_CORRUPT = "); the file is truncated, corrupt or not a torch checkpoint"


@pytest.mark.parametrize("args, words", [((-1, (2,), (1,)), "tensor with a negative offset, size or stride"),
                                         ((3, (2,), (-1,)), "tensor with a negative offset, size or stride"),
                                         ((4, (3,), (1,)), "tensor beyond its storage")])
def test_a_tensor_outside_its_storage_is_refused(tmp_path: Path, capsys, args: tuple, words: str) -> None:
    """Crafted, or damaged where the CRC32 does not see it (a pickle written so): never read past the storage."""
    rebuilt = _Reduce(torch._utils._rebuild_tensor_v2, (_float_storage(), *args, False, collections.OrderedDict()))
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, _carrying(rebuilt)), tmp_path))
    assert line == (f"ERROR: {tmp_path / 'ckpts' / SHARD.format(0)}: cannot read checkpoint (unpickling failed: "
                    f"UnpicklingError: {words}{_CORRUPT}")


def test_a_persistent_id_not_of_a_storage_is_refused(tmp_path: Path, capsys) -> None:
    pattern, path = _write(tmp_path), tmp_path / "ckpts" / SHARD.format(1)
    tag = b"X\x07\x00\x00\x00storage"  # the persistent id's first item, at protocol 2
    _rewrite_zip(path, lambda name, data: data.replace(tag, tag[:-1] + b"X", 1) if name.endswith("data.pkl") else data)
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert line.startswith(f"ERROR: {path}: cannot read checkpoint (unpickling failed: UnpicklingError: persistent id "
                           "('storagX'") and line.endswith(_CORRUPT)


@pytest.mark.parametrize("records, words", [({"readme.txt": b"hi"}, "file in archive is not in a subdirectory"),
                                            ({"archive/version": b"3\n"}, "data.pkl")], ids=["any-zip", "no-pickle"])
def test_a_zip_file_that_is_not_a_torch_checkpoint_is_refused(tmp_path: Path, capsys, records, words: str) -> None:
    path = tmp_path / "ckpts" / "consolidated.pt"
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    line = _fails(tmp_path, capsys, ["--input", str(path), "--output", str(tmp_path / "out" / "x.pt")])
    assert line.startswith(f"ERROR: {path}: cannot read checkpoint (") and words in line and line.endswith(_CORRUPT)


@pytest.mark.parametrize("value, why", [
    (_Reduce(torch._utils._rebuild_tensor_v2, (_float_storage(), 0, (3,), (1,), False, collections.OrderedDict(),
                                               {"a": 1})), "tensor with hooks or metadata"),
    (_Reduce(torch._utils._rebuild_parameter, (torch.zeros(3), False, collections.OrderedDict([(1, "x")]))),
     "parameter with hooks, or not of a tensor"),
    ("big-endian", "big-endian file")], ids=["tensor-metadata", "parameter-hooks", "big-endian"])
def test_what_the_reader_does_not_take_is_loaded_with_torch(tmp_path: Path, capsys, value: Any, why: str) -> None:
    pattern = _write(tmp_path, None if value == "big-endian" else _carrying(value))
    if value == "big-endian":
        _rewrite_zip(tmp_path / "ckpts" / SHARD.format(0), lambda name, data: b"big" if name.endswith("/byteorder")
                     else data)
    assert main(_args(pattern, tmp_path, "--num-output-shards", "2")) == 0
    assert f"{tmp_path / 'ckpts' / SHARD.format(0)}: {why}; loading it with torch, into memory" in (
        capsys.readouterr().err)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["shard0.pt", "shard1.pt"]


def test_names_whose_shard_index_cannot_be_told_are_refused(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    for r in range(4):
        (tmp_path / "ckpts" / SHARD.format(r)).rename(tmp_path / "ckpts" / f"r{r}_x{3 - r}.pt")
    line = _fails(tmp_path, capsys, _args(str(tmp_path / "ckpts" / "r*.pt"), tmp_path))
    assert line.startswith(f"ERROR: {tmp_path / 'ckpts' / 'r0_x3.pt'}, ") and line.endswith(
        "(4 files): cannot tell which number in the names is the shard index; name the files '...shard{i}.pt'")


# --- EMA mirrors (extra_state['ema']) and consolidated files --------------------------------------


def _with_ema(change: Spoil) -> Spoil:
    def spoil(shards: list[dict[str, Any]]) -> None:
        for shard in shards:
            shard["extra_state"]["ema"] = {k: v.clone() for k, v in shard["model"].items()}
        change(shards)
    return spoil


@pytest.mark.parametrize("value, kind", [([1, 2], "list"), (None, "NoneType"), (torch.zeros(3), "tensor")])
def test_an_ema_mirror_of_another_type_than_input_0s_is_refused(tmp_path: Path, capsys, value, kind: str) -> None:
    pattern = _write(tmp_path, _with_ema(lambda shards: shards[1]["extra_state"].__setitem__("ema", value)))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path, "--num-output-shards", "2"))
    assert line == (f"ERROR: {tmp_path / 'ckpts' / SHARD.format(1)}: extra_state['ema'] is a {kind}, unlike input 0's "
                    "dict laid out like model; the shards come from different runs")


def test_an_ema_entry_that_is_no_dict_on_input_0_is_refused_beside_mirrors_and_carried_alone(tmp_path: Path,
                                                                                              capsys) -> None:
    pattern = _write(tmp_path, _with_ema(lambda shards: shards[0]["extra_state"].__setitem__("ema", [1, 2])))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path, "--num-output-shards", "2"))
    assert line == (f"ERROR: {tmp_path / 'ckpts' / SHARD.format(0)}: extra_state['ema'] is a list, unlike "
                    f"{tmp_path / 'ckpts' / SHARD.format(1)}'s dict laid out like model; the shards come from "
                    "different runs")
    (tmp_path / "ckpts2").mkdir()
    pattern = _write(tmp_path / "ckpts2", lambda shards: [s["extra_state"].__setitem__("ema", [1, 2]) for s in shards])
    assert main(_args(pattern, tmp_path, "--num-output-shards", "2", "--quiet")) == 0  # not a mirror: carried
    assert [load_checkpoint(tmp_path / "out" / f"shard{i}.pt")["extra_state"]["ema"] for i in (0, 1)] == [[1, 2]] * 2


def test_an_ema_mirror_whose_flat_tensor_has_another_length_is_refused(tmp_path: Path, capsys) -> None:
    def shorten(shards: list[dict[str, Any]]) -> None:
        ema = shards[2]["extra_state"]["ema"]
        ema["flat_param_0"] = ema["flat_param_0"][:-1].clone()
    line = _fails(tmp_path, capsys, _args(_write(tmp_path, _with_ema(shorten)), tmp_path, "--num-output-shards", "2"))
    assert line == (f"ERROR: {tmp_path / 'ckpts' / SHARD.format(2)}: extra_state['ema']['flat_param_0'] is [6], "
                    "not [7] like model's; extra_state['ema'] must hold the flat parameters exactly as model does "
                    "to be resharded")


def test_a_consolidated_tie_that_shard_metadata_does_not_record_reshards(tmp_path: Path) -> None:
    """The tied head is the embedding's tensor, but shard_metadata has no shared_param_info (edited, or another
    tool's): not taken for a tie FSDP's flat shards cannot hold; the flat parameters come out as with the tie."""
    path = tmp_path / "c.pt"
    assert main(["--input", _write(tmp_path), "--output", str(path), "--unflatten-weights", "--quiet"]) == 0
    consolidated = load_checkpoint(path)
    for instance in consolidated["shard_metadata"]["param_metadata"]:
        instance["shared_param_info"] = []
    torch.save(consolidated, tmp_path / "untied.pt")
    for name in ("c.pt", "untied.pt"):
        assert main(_args(str(tmp_path / name), tmp_path / name[:-3], "--num-output-shards", "2", "--quiet")) == 0
    for i in (0, 1):
        tied, untied = (load_checkpoint(tmp_path / name / "out" / f"shard{i}.pt")["model"] for name in ("c", "untied"))
        assert all(torch.equal(tied[k], untied[k]) for k in tied)


def test_a_consolidated_weight_whose_shape_was_changed_is_refused(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.pt"
    assert main(["--input", _write(tmp_path), "--output", str(path), "--unflatten-weights", "--quiet"]) == 0
    consolidated = load_checkpoint(path)
    consolidated["model"]["decoder.layers.0.fc1.weight"] = torch.zeros(5, 4)
    torch.save(consolidated, path)
    line = _fails(tmp_path, capsys, _args(str(path), tmp_path, "--num-output-shards", "2"))
    assert line == (f"ERROR: {path}: model['decoder.layers.0.fc1.weight'] has shape [5, 4] but shard_metadata says "
                    "[5, 3]; its weights and shard_metadata are not of one model (edited?)")


# --- outputs and options -------------------------------------------------------------------------


def test_output_that_is_an_input(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    target = tmp_path / "ckpts" / SHARD.format(0)
    line = _fails(tmp_path, capsys, ["--input", pattern, "--output", str(target), "--overwrite"])
    assert f"{target} is also an input" in line


def test_output_that_is_an_input_through_a_symlink(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "ckpts")
    line = _fails(tmp_path, capsys, ["--input", pattern, "--output", str(tmp_path / "link" / SHARD.format("{i}")),
                                     "--num-output-shards", "4", "--overwrite"])
    assert "is also an input" in line


def test_output_that_is_a_directory(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "dir.pt").mkdir()
    assert "dir.pt is a directory" in _fails(tmp_path, capsys, ["--input", pattern, "--output", str(tmp_path / "dir.pt")])


def test_output_in_a_folder_that_is_a_file(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "notes").write_text("")
    line = _fails(tmp_path, capsys, ["--input", pattern, "--output", str(tmp_path / "notes" / "new" / "x.pt")])
    assert f"would be in {tmp_path}/notes, which is a file, not a folder; give a path in a folder" in line


@pytest.mark.parametrize("name, example", [("new/", "new/reshard-model_part-0.pt"), ("", "reshard-model_part-0.pt")])
def test_output_name_that_names_no_file(tmp_path: Path, capsys, monkeypatch, name: str, example: str) -> None:
    pattern = _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    line = _fails(tmp_path, capsys, ["--input", pattern, "--output", name])
    assert line.endswith(f"--output-shard-name {name!r} names no file; give one, e.g. {example!r}")


def test_overwrite_that_would_leave_an_earlier_runs_extra_shards_beside_the_outputs(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    out = tmp_path / "keep" / "s{i}.pt"
    assert main(["--input", pattern, "--output", str(out), "--num-output-shards", "4", "--quiet"]) == 0
    line = _fails(tmp_path, capsys, ["--input", pattern, "--output", str(out), "--num-output-shards", "2", "--overwrite"])
    assert f"{tmp_path}/keep/s2.pt, {tmp_path}/keep/s3.pt, named like the outputs, would stay beside them" in line
    assert main(["--input", pattern, "--output", str(out), "--num-output-shards", "5", "--overwrite", "--quiet"]) == 0


def test_existing_output_is_not_overwritten_without_flag(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "shard1.pt").write_bytes(b"precious")
    argv = ["--input", pattern, "--output", str(tmp_path / "keep" / "shard{i}.pt"), "--num-output-shards", "3"]
    line = _fails(tmp_path, capsys, argv)
    assert "shard1.pt already exist(s); pass --overwrite" in line
    assert sorted(p.name for p in (tmp_path / "keep").iterdir()) == ["shard1.pt"]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--num-output-shards", "2", "--output", "OUT/one.pt"], "--num-output-shards=2 but --output-shard-name"),
        (["--num-output-shards", "2", "--output", "OUT/x{k}-{i}.pt"], "{k} is not a placeholder of the name; use "
                                                                       "'{i}' (the shard index) and '{j}'"),
        (["--num-output-shards", "2", "--unflatten-weights"], "--unflatten-weights needs --num-output-shards=1"),
        (["--num-output-shards", "0"], "--num-output-shards=0: must be at least 1"),
        (["--num-output-shards", "-3"], "--num-output-shards=-3: must be at least 1"),
        (["--num-output-shards", "two"], "--num-output-shards: invalid int value: 'two'"),
        (["--output-dtype", "fp8"], "--output-dtype: invalid choice: 'fp8'"),
        (["--unflatten-weights", "maybe"], "expected True or False, got 'maybe'"),
        (["--num-workers", "0"], "argument --num-workers: must be at least 1, got 0"),
    ],
)
def test_bad_options(tmp_path: Path, capsys, extra: list[str], words: str) -> None:
    pattern = _write(tmp_path)
    extra = [str(tmp_path / "out" / "one.pt") if e == "OUT/one.pt" else e for e in extra]
    assert words in _fails(tmp_path, capsys, _args(pattern, tmp_path, *extra))


def test_one_file_given_as_two_shards_is_refused(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    last = sorted(Path(tmp_path / "ckpts").glob("*.pt"))[-1]
    last.unlink()
    last.symlink_to(last.parent / last.name.replace("shard3", "shard2"))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert f"{last.parent / last.name.replace('shard3', 'shard2')} and {last} are the same file (a link?)" in line


@pytest.mark.parametrize("output", ["o/{i}/../s.pt", "o/s{i}.pt/../s.pt"])
def test_output_names_that_alias_one_file(tmp_path: Path, capsys, output: str) -> None:
    argv = ["--input", _write(tmp_path), "--output", str(tmp_path / output), "--num-output-shards", "3"]
    first, second = (str(tmp_path / output.replace("{i}", str(i))) for i in (0, 1))
    assert f"{first} and {second} are the same file; give each output a file name of its own" in _fails(
        tmp_path, capsys, argv)


def test_model_part_output_aliasing_another_part_or_its_input(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path).replace("model_part-0", "model_part-{j}")
    write_shards(make_shards(make_model(seed=1), 4), tmp_path / "ckpts", part=1)
    same = ["--output", str(tmp_path / "o" / "{j}" / ".." / "s{i}.pt")]
    line = _fails(tmp_path, capsys, ["--input", pattern, *same])
    assert f"{tmp_path}/o/0/../s0.pt and {tmp_path}/o/1/../s0.pt are the same file" in line
    (tmp_path / "x0").symlink_to(tmp_path / "ckpts")  # part 0 would write over part 1's inputs
    over = ["--output", str(tmp_path / "x{j}" / SHARD.replace("-0-", "-1-").format("{i}")), "--overwrite"]
    line = _fails(tmp_path, capsys, ["--input", pattern, "--num-output-shards", "4", *over])
    assert f"{tmp_path}/x0/{SHARD.replace('-0-', '-1-').format(0)} is also an input; write to another name" in line


def test_unflattened_file_given_with_shards(tmp_path: Path, capsys) -> None:
    pattern = _write(tmp_path)
    assert main(["--input", pattern, "--output", str(tmp_path / "u" / "shard4.pt"), "--unflatten-weights", "--quiet"]) == 0
    (tmp_path / "u" / "shard4.pt").rename(tmp_path / "ckpts" / SHARD.format(4))
    line = _fails(tmp_path, capsys, _args(pattern, tmp_path))
    assert f"{SHARD.format(4)}: looks unflattened" in line
