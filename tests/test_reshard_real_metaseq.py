"""Resharding checkpoints built to upstream metaseq's exact structure (tests/real_metaseq.py, real fairscale FSDP).

fp16 flat parameters, tuple shapes, Namespace cfgs, int steps, a rank-0 LockingArray of a module
this project does not have, EMA shards, --fp16-adam-stats moments, a DictConfig `restored.pt`.
"""
from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metaseq.benchmark.upstream_stubs import upstream_classes
from metaseq.cli import interactive_cli
from metaseq.errors import CheckpointLoadError
from metaseq.file_io import load_checkpoint
from metaseq.scripts.compare_checkpoints import main as compare
from metaseq.scripts.reshard_fsdp import main as reshard
from metaseq.scripts.reshard_model_parallel import main as reshard_mp
from real_metaseq import (EMA_KEYS, RESTORED, RealRunSpec, expected_tokenization_cache, load_real, real_run_paths,
                          write_real_runs)

REPO = Path(__file__).resolve().parents[1]
SHARDS = "checkpoint_last-model_part-0-shard*.pt"
SHARDED = ("model", "shard_metadata", "last_optimizer_state", "extra_state")  # the rest: rank 0's, carried


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict[str, Path]:
    """Two real-structured runs on 4 ranks: with EMA and a DictConfig restored.pt, and with fp16 Adam stats."""
    plain, fp16_stats = tmp_path_factory.mktemp("real"), tmp_path_factory.mktemp("real_fp16_stats")
    write_real_runs([(plain, RealRunSpec(4, updates=2, restored=True)),
                     (fp16_stats, RealRunSpec(4, updates=2, fp16_adam_stats=True, ema=False))])
    return {"plain": plain, "fp16_stats": fp16_stats}


def _reshard(src: str, out: Path, *flags: str) -> None:
    assert reshard(["--input", src, "--output", str(out), "--quiet", *flags]) == 0


def _assert_same(a, b, where: str) -> None:
    """Tensors bit for bit (dtype and shape too), everything else equal, recursively (dict order aside:
    outputs list a model's flat parameters before its buffers)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, list(a), list(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


@pytest.mark.parametrize("via", [["--num-output-shards", "3"], ["--unflatten-weights", "True"]], ids=["4-3-4", "4-1-4"])
def test_round_trip_is_bit_identical_and_carries_every_object(real, tmp_path, via):
    """No --trust-checkpoint: nothing of the checkpoint's classes is loaded, all of it comes back."""
    _reshard(str(real["plain"] / SHARDS), tmp_path / "mid" / "m{i}.pt", *via)
    _reshard(str(tmp_path / "mid" / "m*.pt"), tmp_path / "back" / "s{i}.pt", "--num-output-shards", "4")
    inputs = [load_real(p) for p in sorted(real["plain"].glob(SHARDS))]
    for rank, want in enumerate(inputs):
        got = load_real(tmp_path / "back" / f"s{rank}.pt")
        assert list(got) == list(want)  # top-level keys in the inputs' order
        _assert_same(got["model"], want["model"], "model")  # fp16 flat parameters and buffer
        _assert_same(got["shard_metadata"], want["shard_metadata"], "shard_metadata")  # tuple shapes too
        for k, state in want["last_optimizer_state"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                _assert_same(got["last_optimizer_state"]["state"][k][name], state[name], f"state {k} {name}")
        for key in EMA_KEYS:  # this rank's EMA shards, resharded like the model
            _assert_same(got["extra_state"][key], want["extra_state"][key], key)
        carried, extra = _without_cache(inputs[0]["extra_state"]), _without_cache(got["extra_state"])
        _assert_same(extra, carried, "extra_state")  # rank 0's metrics, rng states, data position
        for key in (k for k in want if k not in SHARDED):  # cfg with its Namespaces, optimizer_history, ...
            expected = inputs[0][key]
            if key == "cfg":  # with the output's rank; device_id (a GPU of the node) stays rank 0's
                section = {**expected["distributed_training"], "distributed_rank": rank}
                expected = {**expected, "distributed_training": section}
            _assert_same(got[key], expected, key)
        # upstream keeps the tokenization cache on rank 0 alone; outputs do too when the inputs say so
        cache = got["extra_state"]["train_iterator"]["tokenization_cache"]
        assert cache == expected_tokenization_cache(0) if rank == 0 or "--unflatten-weights" in via else cache is None


def _without_cache(extra: dict) -> dict:
    out = {k: v for k, v in extra.items() if k not in EMA_KEYS}
    out["train_iterator"] = {k: v for k, v in out["train_iterator"].items() if k != "tokenization_cache"}
    return out


def test_real_shards_are_resharded_without_torch_or_their_classes(real, tmp_path):
    code = ("import sys\nfrom metaseq.scripts.reshard_fsdp import main\n"
            f"rc = main(['--input', {str(real['plain'] / SHARDS)!r}, '--output', {str(tmp_path / 's{i}.pt')!r},"
            " '--num-output-shards', '3'])\nprint(rc, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["0", "False"], proc.stderr
    assert "carrying objects of argparse.Namespace, metaseq.data.document_to_sequence.LockingArray" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ema_is_cut_like_the_model(real, tmp_path):
    _reshard(str(real["plain"] / SHARDS), tmp_path / "s{i}.pt", "--num-output-shards", "3")
    for rank in range(3):
        got = load_real(tmp_path / f"s{rank}.pt")
        for key in EMA_KEYS:
            for name, tensor in got["model"].items():
                assert got["extra_state"][key][name].shape == tensor.shape, (rank, key, name)
            assert got["extra_state"][key]["flat_param_0"].dtype == (torch.float16 if key == "ema" else torch.float32)
    assert compare([str(real["plain"] / SHARDS), str(tmp_path / "s*.pt")]) == 0


def test_fp16_adam_stats_stay_exact_or_are_refused(real, tmp_path, capsys):
    src = str(real["fp16_stats"] / SHARDS)
    _reshard(src, tmp_path / "same" / "s{i}.pt", "--num-output-shards", "4")  # the same elements per rank
    for rank, path in enumerate(sorted(real["fp16_stats"].glob(SHARDS))):
        want, got = load_real(path), load_real(tmp_path / "same" / f"s{rank}.pt")
        _assert_same(got["last_optimizer_state"], want["last_optimizer_state"], f"rank {rank}")
    for flags in (["--num-output-shards", "3"], ["--unflatten-weights", "True"]):
        assert reshard(["--input", src, "--output", str(tmp_path / "no" / "s{i}.pt"), "--quiet", *flags]) == 2
        err = capsys.readouterr().err
        assert "['exp_avg_scale'] differs between the 4 input ranks" in err and "--skip-optimizer-state" in err
        assert not (tmp_path / "no").exists()
    _reshard(src, tmp_path / "weights" / "s{i}.pt", "--num-output-shards", "3", "--skip-optimizer-state", "True")


def test_compare_catches_a_wrong_scale(real, tmp_path, capsys):
    """Old tools gave every output rank 0's scale: the moments' values change, which compare must see."""
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    paths = sorted(real["fp16_stats"].glob(SHARDS))
    scales = load_real(paths[0])["last_optimizer_state"]["state"]
    for path in paths:
        ckpt = load_real(path)
        for k, state in ckpt["last_optimizer_state"]["state"].items():
            state["exp_avg_scale"] = scales[k]["exp_avg_scale"].clone()
        with upstream_classes():
            torch.save(ckpt, wrong / path.name)
    assert compare([str(real["fp16_stats"] / SHARDS), str(real["fp16_stats"] / SHARDS)]) == 0
    capsys.readouterr()
    assert compare([str(real["fp16_stats"] / SHARDS), str(wrong / SHARDS)]) == 1
    assert "differs: optimizer exp_avg of" in capsys.readouterr().out


class _Gone:
    """A class saved into a file, then gone from its module (renamed in a later version of the code)."""


def test_missing_class_is_not_called_corruption(tmp_path, monkeypatch):
    torch.save({"model": {}, "kept": _Gone()}, tmp_path / "gone.pt")
    monkeypatch.delattr(sys.modules[__name__], "_Gone")
    with pytest.raises(CheckpointLoadError) as info:
        load_checkpoint(tmp_path / "gone.pt", trust=True)
    assert f"objects of class {__name__}._Gone, which is not defined here" in str(info.value)
    assert "corrupt" not in str(info.value)


def test_missing_module_is_not_called_corruption(real):
    with pytest.raises(CheckpointLoadError) as info:
        load_checkpoint(sorted(real["plain"].glob(SHARDS))[0], trust=True)  # torch.load needs the class
    message = str(info.value)
    assert "metaseq.data.document_to_sequence" in message and "not installed" in message
    assert "corrupt" not in message


def test_interactive_cli_serves_consolidated_real_files(real, tmp_path, capsys, monkeypatch):
    """A consolidation of real shards (LockingArray inside) and upstream's DictConfig restored.pt answer alike."""
    _reshard(str(real["plain"] / SHARDS), tmp_path / "reshard-model_part-0.pt", "--unflatten-weights", "True",
             "--skip-optimizer-state", "True")
    answers = []
    for path in (tmp_path / "reshard-model_part-0.pt", real["plain"] / RESTORED):
        monkeypatch.setattr(sys, "stdin", io.StringIO("what is the meaning of life?\n"))
        assert interactive_cli.main(["--path", str(path), "--max-new-tokens", "6"]) == 0, capsys.readouterr().err
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and answers[0].strip()


def test_drop_metaseq_req_works_on_real_shards(real, tmp_path):
    """Upstream's --drop-metaseq-req exists for the rank-0 data loader object: it needs no loading here either."""
    _reshard(str(real["plain"] / SHARDS), tmp_path / "s{i}.pt", "--num-output-shards", "2", "--drop-metaseq-req")
    for rank in range(2):
        got = load_real(tmp_path / f"s{rank}.pt")
        assert got["extra_state"]["train_iterator"] is None
        assert isinstance(got["cfg"]["model"], type(load_real(sorted(real["plain"].glob(SHARDS))[0])["cfg"]["model"]))


def test_model_parallel_reshard_to_as_many_parts_keeps_each_parts_own_state(tmp_path, capsys):
    """P = 2 -> Q = 2: part j's files are part j's (its rng tracker states, rank, --fp16-adam-stats scales), not part
    0's; each shard's other objects are its part's rank 0's (but its own rank), as reshard_fsdp gives them. Per-rank
    scales whose elements would move are refused."""
    stats = dict(model_parallel_size=2, ema=False, fp16_adam_stats=True, streaming=False)
    write_real_runs([(tmp_path / "in", RealRunSpec(2, **stats))])
    write_real_runs([(tmp_path / "one", RealRunSpec(1, **stats))])
    assert reshard_mp(["--input", str(tmp_path / "in" / "checkpoint_last-model_part-*-shard*.pt"), "--quiet",
                       "--output", str(tmp_path / "out" / "checkpoint_last-model_part-{j}-shard{i}.pt"),
                       "--num-output-parts", "2", "--num-output-shards", "2"]) == 0
    inputs = real_run_paths(tmp_path / "in", 2, 2)
    assert [p.name for p in inputs] == [p.name for p in sorted((tmp_path / "out").iterdir())]
    for index, path in enumerate(inputs):
        want, got, first = load_real(path), load_real(tmp_path / "out" / path.name), load_real(inputs[index // 2 * 2])
        for key in ("model", "shard_metadata", "last_optimizer_state"):
            _assert_same(got[key], want[key], f"{path.name} {key}")
        for key in (k for k in want if k not in ("model", "shard_metadata", "last_optimizer_state")):
            expected = first[key]
            if key == "cfg":  # with the file's own rank
                rank = want["cfg"]["distributed_training"]["distributed_rank"]
                expected = {**expected, "distributed_training": {**expected["distributed_training"],
                                                                 "distributed_rank": rank}}
            _assert_same(got[key], expected, f"{path.name} {key}")
    assert not torch.equal(*(load_real(p)["extra_state"]["rng_tracker_states"]["model-parallel-rng"]
                             for p in inputs[::2]))  # the parts' states differ: a copy of part 0's would show
    for run, flags in (("in", ["--num-output-parts", "2", "--num-output-shards", "3"]),
                       ("one", ["--num-output-parts", "1"])):  # one shard per part: the parts' scales differ
        assert reshard_mp(["--input", str(tmp_path / run / "checkpoint_last-model_part-*-shard*.pt"), "--quiet",
                           "--output", str(tmp_path / "no" / "checkpoint_last-model_part-{j}-shard{i}.pt"),
                           *flags]) == 2
        assert "['exp_avg_scale'] differs between" in capsys.readouterr().err and not (tmp_path / "no").exists()


def test_upstream_restored_file_is_the_same_model_as_its_shards(real, capsys):
    """restored.pt leaves out the tied head, the version buffer and EMA: the head is the embedding, as inference
    takes it; the others are noted, not called differences."""
    assert compare([str(real["plain"] / RESTORED), str(real["plain"] / SHARDS)]) == 0
    out = capsys.readouterr().out
    assert "note: decoder.version only in B; not compared\nnote: extra_state.ema only in B; not compared\n" in out
    assert out.strip().endswith("SAME: the checkpoints hold the same model"), out


def test_a_cfg_carried_unread_is_read_for_the_checks_and_gets_each_outputs_rank(real, tmp_path, capsys):
    """A whole cfg as an omegaconf DictConfig (as upstream's restored.pt has it), carried unread: its seed still tells
    two runs apart, and each of 3 outputs says its own rank and world size, as a dict cfg would."""
    from omegaconf import DictConfig, OmegaConf

    for rank, path in enumerate(sorted(real["plain"].glob(SHARDS))):
        ckpt = load_real(path)
        ckpt["cfg"] = OmegaConf.create(ckpt["cfg"], flags={"allow_objects": True})  # Namespace values, as upstream
        OmegaConf.set_struct(ckpt["cfg"], True)
        with upstream_classes():
            torch.save(ckpt, tmp_path / path.name)
    _reshard(str(tmp_path / SHARDS), tmp_path / "out" / "s{i}.pt", "--num-output-shards", "3")
    for rank in range(3):
        cfg = load_real(tmp_path / "out" / f"s{rank}.pt")["cfg"]
        assert isinstance(cfg, DictConfig) and OmegaConf.is_struct(cfg)
        assert (cfg.distributed_training.distributed_rank, cfg.distributed_training.distributed_world_size) == (rank, 3)
        assert cfg.common.seed == load_real(tmp_path / SHARDS.replace("*", "0"))["cfg"].common.seed
    assert compare([str(real["plain"] / SHARDS), str(tmp_path / "out" / "s*.pt")]) == 0, capsys.readouterr().out
    other = load_real(tmp_path / SHARDS.replace("*", "1"))
    other["cfg"].common.seed += 1  # shard 1 of another run
    with upstream_classes():
        torch.save(other, tmp_path / SHARDS.replace("*", "1"))
    capsys.readouterr()
    assert reshard(["--input", str(tmp_path / SHARDS), "--output", str(tmp_path / "mixed" / "s{i}.pt")]) == 2
    assert "the files mix two training runs" in capsys.readouterr().err
