"""Foundation: real fairscale FSDP training on CPU/gloo writes FORMAT.md shards."""
import logging
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TRAIN_UPDATES
from metaseq.checkpoint_utils import RestoreError, find_restore_files
from metaseq.cli import train
from metaseq.distributed.fsdp import start_ranks
from metaseq.file_io import load_checkpoint
from metaseq.scripts.reshard_fsdp import main as reshard_main
from real_metaseq import RealRunSpec, write_real_runs
from training import CORPUS, losses, run_train

TOP_LEVEL_KEYS = {"model", "shard_metadata", "last_optimizer_state", "optimizer_history", "extra_state", "cfg"}
FLAT_KEYS = {"flat_param_0", "decoder.layers.0.flat_param_0", "decoder.layers.1.flat_param_0"}


def _shards(save_dir, w, prefix="checkpoint_last"):
    return [load_checkpoint(save_dir / f"{prefix}-model_part-0-shard{r}.pt") for r in range(w)]


@pytest.mark.parametrize("w", [1, 2, 4])
def test_shards_have_format_keys_and_fairscale_metadata(trained, w):
    save_dir, _ = trained[w]
    for rank, ckpt in enumerate(_shards(save_dir, w)):
        assert set(ckpt) == TOP_LEVEL_KEYS
        assert set(ckpt["model"]) == FLAT_KEYS | {"decoder.version"}
        meta = ckpt["shard_metadata"]
        assert [m["fsdp_path"] for m in meta["param_metadata"]] == ["", "decoder.layers.0", "decoder.layers.1"]
        assert meta["buffer_names"] == ["decoder.version"]
        root = meta["param_metadata"][0]
        assert root["shared_param_info"] == [("decoder.embed_tokens.weight", "decoder.output_projection.weight")]
        for inst in meta["param_metadata"]:
            p = inst["params"]["flat_param_0"]
            key = f"{inst['fsdp_path']}.flat_param_0".lstrip(".")
            flat = ckpt["model"][key]
            assert flat.dim() == 1
            # Every rank holds ceil(N / W) elements; the padding is what this rank lacks.
            assert flat.numel() == math.ceil(sum(p["numels"]) / w)
            assert p["numels"] == [s.numel() for s in p["shapes"]]
            assert flat.numel() * rank + flat.numel() - p["padding"] <= sum(p["numels"])
        assert ckpt["cfg"]["distributed_training"]["distributed_world_size"] == w
        assert ckpt["cfg"]["distributed_training"]["distributed_rank"] == rank
        assert ckpt["optimizer_history"][-1]["num_updates"] == TRAIN_UPDATES
        assert ckpt["extra_state"]["train_iterator"] == {"samples_seen": 8 * TRAIN_UPDATES}


@pytest.mark.parametrize("w", [1, 2, 4])
def test_optimizer_state_is_sharded_like_flat_params(trained, w):
    save_dir, _ = trained[w]
    for ckpt in _shards(save_dir, w):
        osd = ckpt["last_optimizer_state"]
        flats = [ckpt["model"][k] for k in ("flat_param_0", "decoder.layers.0.flat_param_0", "decoder.layers.1.flat_param_0")]
        assert osd["param_groups"][0]["params"] == [0, 1, 2]
        for k, flat in enumerate(flats):
            assert osd["state"][k]["exp_avg"].shape == flat.shape
            assert osd["state"][k]["exp_avg_sq"].shape == flat.shape
            assert int(osd["state"][k]["step"]) == TRAIN_UPDATES


def test_four_ranks_pad_some_flat_param(trained):
    save_dir, _ = trained[4]
    paddings = [
        inst["params"]["flat_param_0"]["padding"]
        for ckpt in _shards(save_dir, 4)
        for inst in ckpt["shard_metadata"]["param_metadata"]
    ]
    assert max(paddings) > 0


def test_single_rank_is_unpadded_full_flat_param(trained):
    save_dir, _ = trained[1]
    (ckpt,) = _shards(save_dir, 1)
    for inst in ckpt["shard_metadata"]["param_metadata"]:
        p = inst["params"]["flat_param_0"]
        assert p["padding"] == 0


def test_loss_is_independent_of_world_size(trained):
    base = trained[1][1]
    assert sorted(base) == list(range(1, TRAIN_UPDATES + 1))
    for w in (2, 4):
        for update, loss in trained[w][1].items():
            assert abs(loss - base[update]) < 1e-5, (w, update, loss, base[update])
    assert base[TRAIN_UPDATES] < base[1]  # it does learn


def test_resume_continues_exactly_like_uninterrupted_run(trained, tmp_path):
    save_dir, uninterrupted = trained[2]
    proc = run_train(
        tmp_path, world_size=2, max_update=TRAIN_UPDATES,
        extra=["--restore-file", str(save_dir / "checkpoint_4.pt")],
    )
    resumed = losses(proc)
    assert sorted(resumed) == [5, 6]
    for update in (5, 6):
        assert abs(resumed[update] - uninterrupted[update]) < 1e-5
    # And the weights end up the same.
    a, b = _shards(save_dir, 2), _shards(tmp_path, 2)
    for x, y in zip(a, b):
        for key in FLAT_KEYS:
            torch.testing.assert_close(x["model"][key], y["model"][key], rtol=0, atol=1e-6)


def test_quoted_tilde_in_paths_means_the_home_folder(trained, tmp_path, monkeypatch):
    save_dir, uninterrupted = trained[1]
    (tmp_path / "run").symlink_to(save_dir)
    monkeypatch.setenv("HOME", str(tmp_path))
    proc = run_train(Path("~/resumed"), world_size=1, max_update=TRAIN_UPDATES,
                     extra=["--restore-file", "~/run/checkpoint_4.pt"])
    assert sorted(losses(proc)) == [5, 6] and abs(losses(proc)[6] - uninterrupted[6]) < 1e-5
    assert (tmp_path / "resumed" / "checkpoint_last-model_part-0-shard0.pt").is_file()
    assert not Path("~").exists()


def test_restore_file_that_is_a_folder_names_the_checkpoints_in_it(trained):
    save_dir, _ = trained[2]
    with pytest.raises(RestoreError) as error:
        find_restore_files(str(save_dir), 2)
    assert str(error.value) == (f"--restore-file {save_dir}; it is a folder: name a checkpoint in it, e.g. "
                                f"{save_dir}/checkpoint_4.pt, {save_dir}/checkpoint_6.pt, {save_dir}/checkpoint_last.pt")
    pattern = f"{save_dir}/checkpoint_last-model_part-0-shard*.pt"  # the shards, as reshard_fsdp takes them
    with pytest.raises(RestoreError) as error:
        find_restore_files(pattern, 2)
    assert str(error.value) == (f"--restore-file {pattern} is a glob; name the save instead, e.g. --restore-file "
                                f"{save_dir}/checkpoint_last.pt (every part's files are found from it)")


@pytest.mark.parametrize("given, words", [
    ("out/s*.pt", "out/s0.pt is not named as training names its shards (STEM-model_part-J-shardI.pt), which "
                  "restoring reads back; rename them so, or reshard them into such names"),
    ("out/s-shard1.pt", "out/s-shard1.pt is not named as training names its shards"),
    ("out/checkpoint_last-model_part-0.pt", "no such file"),
    ("out/cons-model_part-*.pt", "is a glob; name the save instead, e.g. --restore-file out/cons-model_part-0.pt"),
])
def test_restore_file_of_shards_not_named_as_training_names_them(tmp_path, monkeypatch, given, words):
    """reshard_fsdp and convert_from_hf write any name with '{i}'; training finds a save's shards by its own names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    for name in ("s0.pt", "s1.pt", "s-shard1.pt", "cons-model_part-0.pt", "cons-model_part-1.pt"):
        (tmp_path / "out" / name).write_bytes(b"")
    joined = " " if "glob" in words else ": "
    with pytest.raises(RestoreError, match=re.escape(f"--restore-file {given}{joined}{words}")):
        find_restore_files(given, 2)


def test_save_after_a_reshard_removes_the_earlier_runs_extra_shards_it_replaces(trained, tmp_path):
    """W=4 run, resharded 4 -> 2 and resumed with --save-dir the W=4 run's folder: checkpoint_6 and checkpoint_last
    are replaced, so their shard2 and shard3 go; checkpoint_4, which this run does not write, stays whole."""
    old_dir, uninterrupted = trained[4]
    run = tmp_path / "run"
    shutil.copytree(old_dir, run)
    assert reshard_main(["--input", str(run / "checkpoint_4-model_part-0-shard*.pt"), "--num-output-shards", "2",
                         "--output", str(tmp_path / "r2" / "checkpoint_last-model_part-0-shard{i}.pt"), "--quiet"]) == 0
    proc = run_train(run, world_size=2, max_update=TRAIN_UPDATES,
                     extra=["--restore-file", str(tmp_path / "r2" / "checkpoint_last.pt")])
    assert ("files of an earlier save under these names, with more shards or model parts, which this save replaces"
            in proc.stderr)
    assert abs(losses(proc)[6] - uninterrupted[6]) < 1e-5
    for prefix, shards in (("checkpoint_4", 4), ("checkpoint_6", 2), ("checkpoint_last", 2)):
        assert sorted(p.name for p in run.glob(f"{prefix}-*")) == [f"{prefix}-model_part-0-shard{r}.pt" for r in range(shards)]
    assert len(find_restore_files(str(run / "checkpoint_last.pt"), 2)) == 2


def test_resume_with_other_world_size_names_reshard_tool(trained, tmp_path):
    save_dir, _ = trained[2]
    proc = run_train(
        tmp_path, world_size=4, max_update=TRAIN_UPDATES,
        extra=["--restore-file", str(save_dir / "checkpoint_last.pt")], check=False,
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1
    assert "found 2 shard files but --world-size=4" in err[0]
    assert "python -m metaseq.scripts.reshard_fsdp" in err[0]
    assert "Traceback" not in proc.stderr


def test_resume_takes_the_restored_runs_seed_lr_and_sequence_length_unless_given(tmp_path):
    """A run with seed 7, lr 0.01 and 48-token sequences (none of them the defaults), resumed by naming only the
    checkpoint, goes on exactly; --lr given on resume is the learning rate from then on."""
    first = tmp_path / "first"
    base = losses(run_train(first, world_size=1, max_update=TRAIN_UPDATES,
                            extra=["--seed", "7", "--lr", "0.01", "--save-interval-updates", "4"]))
    bare = [sys.executable, "-m", "metaseq.cli.train", "--data", str(CORPUS), "--max-update", str(TRAIN_UPDATES),
            "--restore-file", str(first / "checkpoint_4.pt")]
    proc = subprocess.run([*bare, "--save-dir", str(tmp_path / "resumed")], capture_output=True, text=True, check=True)
    assert [losses(proc)[u] for u in (5, 6)] == pytest.approx([base[5], base[6]], abs=1e-5)
    proc = subprocess.run([*bare, "--save-dir", str(tmp_path / "lr"), "--lr", "0.1"], capture_output=True, text=True,
                          check=True)
    assert abs(losses(proc)[6] - base[6]) > 1e-3
    (ckpt,) = _shards(tmp_path / "lr", 1)
    assert [g["lr"] for g in ckpt["last_optimizer_state"]["param_groups"]] == [0.1]
    assert ckpt["cfg"]["optimization"]["lr"] == [0.1] and ckpt["cfg"]["common"]["seed"] == 7
    assert ckpt["cfg"]["task"]["seq_len"] == 48


def _mixed(trained, tmp_path) -> str:
    """shard0 of the W=2 run's last save beside shard1 of its update-4 save: a save cut short."""
    save_dir, _ = trained[2]
    shutil.copy(save_dir / "checkpoint_last-model_part-0-shard0.pt", tmp_path)
    shutil.copy(save_dir / "checkpoint_4-model_part-0-shard1.pt", tmp_path / "checkpoint_last-model_part-0-shard1.pt")
    return str(tmp_path / "checkpoint_last.pt")


def _two_runs(trained, tmp_path) -> str:
    """shard1 of another run with the same seed and update (another --lr) beside shard0 of the W=2 run."""
    run_train(tmp_path / "other", world_size=2, max_update=TRAIN_UPDATES, extra=["--lr", "1e-4"])
    shutil.copy(trained[2][0] / "checkpoint_last-model_part-0-shard0.pt", tmp_path)
    shutil.copy(tmp_path / "other" / "checkpoint_last-model_part-0-shard1.pt", tmp_path)
    return str(tmp_path / "checkpoint_last.pt")


def _data_positions_differ(trained, tmp_path) -> str:
    """shard1's data position edited: its rank would read other batches than rank 0."""
    for rank in range(2):
        ckpt = load_checkpoint(trained[2][0] / f"checkpoint_last-model_part-0-shard{rank}.pt")
        ckpt["extra_state"]["train_iterator"]["samples_seen"] += 8 * rank
        torch.save(ckpt, tmp_path / f"checkpoint_last-model_part-0-shard{rank}.pt")
    return str(tmp_path / "checkpoint_last.pt")


def _flat_single_file(trained, tmp_path) -> str:
    shutil.copy(trained[1][0] / "checkpoint_last-model_part-0-shard0.pt", tmp_path / "reshard-model_part-0.pt")
    return str(tmp_path / "reshard-model_part-0.pt")


def _edited(**model_cfg):
    """The W=2 run's last save with cfg['model'] changed: weights its cfg does not describe."""
    def edit(trained, tmp_path) -> str:
        for rank in range(2):
            ckpt = load_checkpoint(trained[2][0] / f"checkpoint_last-model_part-0-shard{rank}.pt")
            ckpt["cfg"]["model"].update(model_cfg)
            torch.save(ckpt, tmp_path / f"checkpoint_last-model_part-0-shard{rank}.pt")
        return str(tmp_path / "checkpoint_last.pt")
    return edit


def _saved(edit: Callable[[dict], None]) -> Callable:
    """The W=2 run's last save with `edit` applied to each file, as a hand-edited checkpoint."""
    def write(trained, tmp_path) -> str:
        for rank in range(2):
            ckpt = load_checkpoint(trained[2][0] / f"checkpoint_last-model_part-0-shard{rank}.pt")
            edit(ckpt)
            torch.save(ckpt, tmp_path / f"checkpoint_last-model_part-0-shard{rank}.pt")
        return str(tmp_path / "checkpoint_last.pt")
    return write


def _broken_link(trained, tmp_path) -> str:
    shutil.copy(trained[2][0] / "checkpoint_last-model_part-0-shard0.pt", tmp_path)
    os.symlink(tmp_path / "gone.pt", tmp_path / "checkpoint_last-model_part-0-shard1.pt")
    return str(tmp_path / "checkpoint_last.pt")


def _last_shard_missing(trained, tmp_path) -> str:
    shutil.copy(trained[2][0] / "checkpoint_last-model_part-0-shard0.pt", tmp_path)
    return str(tmp_path / "checkpoint_last.pt")


def _consolidated_optimizer_without_id_map(trained, tmp_path) -> str:
    path = tmp_path / "reshard-model_part-0.pt"
    assert reshard_main(["--input", str(trained[2][0] / "checkpoint_last-model_part-0-shard*.pt"), "--output",
                         str(path), "--unflatten-weights", "True", "--quiet"]) == 0
    ckpt = load_checkpoint(path)
    del ckpt["last_optimizer_state"]["param_id_map"]
    torch.save(ckpt, path)
    return str(path)


def _not_a_training_checkpoint(trained, tmp_path) -> str:
    torch.save({"a": 1}, tmp_path / "a.pt")
    return str(tmp_path / "a.pt")


@pytest.mark.parametrize(
    "restore, flags, culprit",
    [
        (None, ["--max-update", "6"], "--max-update=6 but --restore-file {R} was saved at update 6: nothing to train; "
                                      "pass a --max-update above 6"),
        (_mixed, [], "{T}/checkpoint_last-model_part-0-shard1.pt was saved at update 4 but "
                     "{T}/checkpoint_last-model_part-0-shard0.pt at update 6: the files come from different saves"),
        (None, ["--decoder-layers", "3"], "--decoder-layers=3 but the restored model has decoder_layers=2: a restored "
                                          "model's sizes come from its files; drop --decoder-layers"),
        (None, ["--seq-len", "100"], "--seq-len=100 exceeds the restored model's max_target_positions=67"),
        (_flat_single_file, [], "--restore-file {R} holds the flat weights of one FSDP shard, which load only with one "
                                "rank per model part (--world-size 1)"),
        (_not_a_training_checkpoint, [], "--restore-file {R}: {R}: no 'model' dict"),
        (_two_runs, [], "{T}/checkpoint_last-model_part-0-shard1.pt comes from training run "),
        (_data_positions_differ, [], "{T}/checkpoint_last-model_part-0-shard1.pt is at sample 56 of the data but "
                                     "{T}/checkpoint_last-model_part-0-shard0.pt at 48"),
        (_edited(decoder_ffn_embed_dim=64), [], "--restore-file {R}: 'decoder.layers.0.fc1.weight' is [71, 30] in "
                                                "the weights but [64, 30] in the model its config describes; its "
                                                "cfg['model'] does not describe its weights (edited?)"),
        (_edited(decoder_layers=3), [], "--restore-file {R}: the weights lack 'decoder.layers.2."),
        (_broken_link, [], "{T}/checkpoint_last-model_part-0-shard1.pt is a broken symbolic link (to {T}/gone.pt, "
                           "which does not exist); restore that file, or remove the link"),
        (_last_shard_missing, [], "found 1 shard files but --world-size=2; their cfg says the save had 2 shards per "
                                  "model part, so shard(s) 1 seem to be missing"),
        (_consolidated_optimizer_without_id_map, [], "restore a copy without it: reshard_fsdp --skip-optimizer-state "
                                                     "True"),
        (_saved(lambda c: c["cfg"]["common"].update(seed="1")), [], "--restore-file {R}: its cfg['common']['seed'] "
                                                                    "must be an integer, got '1'; pass --seed"),
        (_saved(lambda c: c["cfg"]["optimization"].update(batch_size=0)), [], "its cfg['optimization']['batch_size'] "
                                                                              "must be at least 1, got 0"),
        (_saved(lambda c: c["cfg"]["common"].update(seed=-5)), [], "its cfg['common']['seed'] must be at least 0"),
        (_saved(lambda c: c["cfg"]["task"].update(seq_len=1000)), [], "its cfg['task']['seq_len'] must be at most the "
                                                                      "model's max_target_positions=67, got 1000"),
        (_saved(lambda c: c["optimizer_history"][-1].update(num_updates="6")), [],
         "shard0.pt's optimizer_history[-1]['num_updates'] is '6', not a count"),
        (_saved(lambda c: c["extra_state"]["train_iterator"].update(samples_seen=-8)), [], "is -8, not a count"),
        (_saved(lambda c: c["extra_state"].update(previous_training_time="1")), [], "shard0.pt's extra_state["
         "'previous_training_time'] is '1', not a number of seconds"),
        (_saved(lambda c: c.pop("shard_metadata")), [], "no 'shard_metadata'; it has flat_param_* keys but was saved "
         "without FSDP's local_metadata_dict(); training restores what it or the reshard tools wrote"),
    ],
)
def test_restore_files_that_cannot_go_on_are_refused_before_any_rank_starts(trained, tmp_path, caplog, restore, flags,
                                                                              culprit):
    path = restore(trained, tmp_path) if restore else str(trained[2][0] / "checkpoint_last.pt")
    args = ["--data", str(CORPUS), "--save-dir", str(tmp_path / "run"), "--world-size", "2", "--max-update", "9",
            "--restore-file", path, *flags]
    with caplog.at_level(logging.ERROR, logger="metaseq.cli.train"):
        assert train.main(args) == 2
    assert culprit.format(R=path, T=tmp_path) in caplog.text
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flags, culprit",
    [
        (["--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
        (["--batch-size", "abc"], "argument --batch-size: must be an integer of at least 1, got 'abc'"),
        (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
        (["--decoder-layers", "0"], "argument --decoder-layers: must be at least 1, got 0"),
        (["--data", "{T}/empty.txt"], "--data {T}/empty.txt: the file has no non-empty lines"),
        (["--save-dir", "{T}/empty.txt"], "--save-dir {T}/empty.txt is a file; give a folder for the checkpoints"),
        (["--save-dir", "{T}/empty.txt/run"], "--save-dir {T}/empty.txt/run: cannot make the folder (Not a directory)"),
        (["--seed", str(2**47)], f"--seed={2**47}: give a seed from 0 to {2**46 - 1}"),  # the ranks' torch overflowed
        (["--data", "{T}/pipe"], "--data {T}/pipe is a pipe or device, which every rank reads again; save it to a "),
    ],
)
def test_bad_flag_values_and_paths_are_one_line_errors(tmp_path, caplog, flags, culprit):
    (tmp_path / "empty.txt").write_text("\n \n")
    os.mkfifo(tmp_path / "pipe")  # as `--data <(...)` or /dev/stdin: the check would read it up, the ranks nothing
    args = ["--data", str(CORPUS), "--save-dir", str(tmp_path / "run"), *[f.format(T=tmp_path) for f in flags]]
    with caplog.at_level(logging.ERROR, logger="metaseq.cli.train"):
        assert train.main(args) == 2
    assert culprit.format(T=tmp_path) in caplog.text and len(caplog.records) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "pipe"]


def test_an_error_inside_a_rank_is_one_line(tmp_path):
    """A save that fails on a full disk (here a file size limit) is the rank's error in one line, not a traceback."""
    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    cmd = [sys.executable, "-m", "metaseq.cli.train", "--data", str(CORPUS), "--save-dir", str(tmp_path / "run"),
           "--world-size", "2", "--max-update", "1", "--decoder-layers", "2", "--decoder-embed-dim", "32",
           "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"failed: {tmp_path}/run/checkpoint_1-model_part-0-shard" in last, proc.stderr  # no error type
    assert "cannot save it (File too large); there is no earlier save: fix that (or give another --save-dir)" in last
    assert "Terminating process" not in proc.stderr  # torch's note as it stops the other rank
    assert not list((tmp_path / "run").glob("checkpoint_last*")), "a failed first save must not leave checkpoint_last"


def _fail_first_or_after_a_peer(rank: int) -> None:
    """Rank 1 fails at once but its process lingers (a thread keeps it alive); rank 0 fails a second later, as a
    rank waiting in a collective does once its peer is gone, and its process goes first."""
    if rank == 1:
        threading.Thread(target=time.sleep, args=(3,)).start()
        raise OSError("the cause: rank 1 cannot write its file")
    time.sleep(1)
    raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")


def test_the_error_shown_is_the_rank_that_failed_first():
    with pytest.raises(mp.ProcessRaisedException) as raised:
        start_ranks(_fail_first_or_after_a_peer, (), 2)
    assert raised.value.error_index == 1 and "the cause" in str(raised.value)


def test_a_save_that_fails_on_one_rank_leaves_checkpoint_last_at_the_last_complete_save(tmp_path):
    """Rank 1 cannot write its update-2 file (a folder stands in its way); rank 0 can: checkpoint_last must stay the
    complete update-1 save on both ranks (not rank 0's update 2 beside rank 1's update 1), and restore."""
    blocked = tmp_path / "run" / "checkpoint_2-model_part-0-shard1.pt"
    blocked.mkdir(parents=True)
    proc = run_train(tmp_path / "run", world_size=2, max_update=2, extra=["--save-interval-updates", "1"],
                     check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"rank 1 failed: {blocked}: cannot save it (Is a directory); checkpoint_last is left at the last "
            "complete save") in proc.stderr
    saved = [line for line in proc.stderr.splitlines() if "| saved " in line]
    assert len(saved) == 1 and "checkpoint_1-model_part-0-shard0.pt" in saved[0], proc.stderr
    for rank in range(2):
        ckpt = load_checkpoint(tmp_path / "run" / f"checkpoint_last-model_part-0-shard{rank}.pt")
        assert ckpt["optimizer_history"][-1]["num_updates"] == 1
    restored = run_train(tmp_path / "again", world_size=2, max_update=2,
                         extra=["--restore-file", str(tmp_path / "run" / "checkpoint_last.pt")])
    assert sorted(losses(restored)) == [2]


def test_a_checkpoint_last_that_cannot_be_replaced_names_the_complete_save(tmp_path):
    """Every rank wrote its numbered file, then rank 1 cannot make its checkpoint_last (a folder stands in its way):
    the error is rank 1's and names the numbered save, which restores; checkpoint_last is a link, not a copy."""
    blocked = tmp_path / "run" / "checkpoint_last-model_part-0-shard1.pt"
    blocked.mkdir(parents=True)
    proc = run_train(tmp_path / "run", world_size=2, max_update=1, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"rank 1 failed: {blocked}: cannot replace it (Is a directory); every rank wrote its checkpoint_1 file: "
            f"restore from {tmp_path / 'run' / 'checkpoint_1.pt'}") in proc.stderr
    numbered, last = (tmp_path / "run" / f"checkpoint_{tag}-model_part-0-shard0.pt" for tag in (1, "last"))
    assert os.path.samefile(numbered, last)
    restored = run_train(tmp_path / "again", world_size=2, max_update=2,
                         extra=["--restore-file", str(tmp_path / "run" / "checkpoint_1.pt")])
    assert sorted(losses(restored)) == [2]


def test_sigterm_stops_the_ranks_and_is_one_line(tmp_path):
    """A launcher's SIGTERM to the training process: its ranks stop with it (they would otherwise train on alone),
    its rendezvous folder goes, and it says so in one line with the save to resume from."""
    (tmp_path / "tmp").mkdir()
    cmd = [sys.executable, "-m", "metaseq.cli.train", "--data", str(CORPUS), "--save-dir", str(tmp_path / "run"),
           "--world-size", "2", "--max-update", "100000", "--log-format", "json", "--decoder-layers", "1",
           "--decoder-embed-dim", "16", "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "32"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().startswith('{"num_updates": 1,')  # the ranks are training
        ranks = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True).stdout
        ranks = [int(pid) for pid in ranks.split()]
        assert len(ranks) == 2
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith("terminated by SIGTERM; the last complete save is the one to "
                                                 "--restore-file"), err
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    assert not list((tmp_path / "tmp").glob("metaseq-rdzv-*"))


@pytest.mark.parametrize(
    "flags, culprit",
    [
        (["--batch-size", "6"], "--batch-size=6 is not divisible by --world-size=4"),
        (["--seq-len", "500"], "--seq-len=500 exceeds --max-target-positions"),
        (["--decoder-attention-heads", "4"], "--decoder-embed-dim=30 is not divisible"),
    ],
)
def test_bad_training_flags_give_one_line_error(tmp_path, flags, culprit):
    proc = run_train(tmp_path, world_size=4, max_update=1, extra=flags, check=False)
    assert proc.returncode == 2
    assert culprit in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*.pt"))


def test_new_runs_record_the_opt_exact_variant(trained):
    save_dir, _ = trained[1]
    (ckpt,) = _shards(save_dir, 1)
    assert ckpt["cfg"]["model"]["no_scale_embedding"] is True
    assert ckpt["cfg"]["model"]["position_offset"] == 2
    root = ckpt["shard_metadata"]["param_metadata"][0]["params"]["flat_param_0"]
    shapes = dict(zip(root["names"], root["shapes"]))
    assert tuple(shapes["decoder.embed_positions.weight"]) == (ckpt["cfg"]["model"]["max_target_positions"] + 2, 30)


def test_restore_of_upstream_files_holding_unloadable_objects_is_refused_up_front_with_the_fix(tmp_path, caplog):
    """Upstream's rank-0 tokenization cache (a LockingArray) cannot be unpickled here, even trusted: refused before
    any rank starts, naming --drop-metaseq-req; the copy that flag writes restores."""
    write_real_runs([(tmp_path / "real", RealRunSpec(2, updates=2, ema=False))])
    args = ["--data", str(CORPUS), "--save-dir", str(tmp_path / "run"), "--world-size", "2", "--max-update", "3"]
    for trust in ([], ["--trust-checkpoint"]):
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="metaseq.cli.train"):
            assert train.main([*args, "--restore-file", str(tmp_path / "real" / "checkpoint_last.pt"), *trust]) == 2
        assert "document_to_sequence" in caplog.text and "--drop-metaseq-req writes a copy without it" in caplog.text
        assert not (tmp_path / "run").exists()
    assert reshard_main(["--input", str(tmp_path / "real" / "checkpoint_last-model_part-0-shard*.pt"), "--quiet",
                         "--output", str(tmp_path / "dropped" / "checkpoint_last-model_part-0-shard{i}.pt"),
                         "--num-output-shards", "2", "--drop-metaseq-req"]) == 0
    proc = run_train(tmp_path / "run", world_size=2, max_update=3,
                     extra=["--restore-file", str(tmp_path / "dropped" / "checkpoint_last.pt")])
    assert sorted(losses(proc)) == [3]


def test_restore_without_a_data_position_says_the_data_starts_over(trained, tmp_path, caplog):
    """--drop-metaseq-req drops extra_state['train_iterator'] (upstream's holds no samples_seen either): the resumed
    run reads its data from the beginning, which it must say rather than replay those samples silently."""
    args = ["--data", str(CORPUS), "--save-dir", str(tmp_path / "run"), "--world-size", "2", "--max-update", "9"]
    for drop in ([], ["--drop-metaseq-req"]):
        out = tmp_path / f"out{len(drop)}"
        assert reshard_main(["--input", str(trained[2][0] / "checkpoint_last-model_part-0-shard*.pt"), "--output",
                             str(out / "checkpoint_last-model_part-0-shard{i}.pt"), "--num-output-shards", "2",
                             "--quiet", *drop]) == 0
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="metaseq.cli.train"):
            train.config_from_args(train.build_parser().parse_args(
                [*args, "--restore-file", str(out / "checkpoint_last.pt")]))
        warned = "holds no data position" in caplog.text
        assert warned == bool(drop), caplog.text
    assert f"training starts the data from its beginning, not where update {TRAIN_UPDATES} left it" in caplog.text


def test_restore_of_fp16_adam_stats_takes_each_moment_times_its_ranks_scale(tmp_path):
    """Upstream's --fp16-adam-stats store fp16 moments with a per-rank scale: restored, the run goes on with the
    moments the same run saved in fp32 holds (up to fp16 rounding), not with the scaled-down fp16 numbers
    (fp16 keeps about 1e-3 of the largest moment: the scale is the largest / 65504)."""
    write_real_runs([(tmp_path / name, RealRunSpec(2, updates=2, ema=False, streaming=False, fp16_adam_stats=stats))
                     for name, stats in (("fp32", False), ("fp16", True))])
    moments = {}
    for name in ("fp32", "fp16"):
        run_train(tmp_path / f"{name}-run", world_size=2, max_update=3,
                  extra=["--restore-file", str(tmp_path / name / "checkpoint_last.pt")])
        moments[name] = [s["last_optimizer_state"]["state"][0] for s in _shards(tmp_path / f"{name}-run", 2)]
    for fp32, fp16 in zip(moments["fp32"], moments["fp16"]):
        assert "exp_avg_scale" not in fp16
        for key in ("exp_avg", "exp_avg_sq"):
            assert fp16[key].dtype == torch.float32
            torch.testing.assert_close(fp16[key], fp32[key], rtol=0, atol=1e-3 * fp32[key].abs().max().item())
    consolidated = tmp_path / "consolidated.pt"
    assert reshard_main(["--input", str(tmp_path / "fp32" / "checkpoint_last-model_part-0-shard*.pt"), "--quiet",
                         "--output", str(consolidated), "--unflatten-weights"]) == 0
    ckpt = torch.load(consolidated, weights_only=False)
    for entry in ckpt["last_optimizer_state"]["state"].values():  # as gather_full_optim_state_dict lists scales
        entry["exp_avg_scale"] = [torch.tensor(1.0), torch.tensor(2.0)]
    torch.save(ckpt, consolidated)
    proc = run_train(tmp_path / "consolidated-run", world_size=2, max_update=3, check=False,
                     extra=["--restore-file", str(consolidated)])
    assert proc.returncode == 2 and "consolidated optimizer state holds --fp16-adam-stats" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not list((tmp_path / "consolidated-run").glob("*.pt"))
