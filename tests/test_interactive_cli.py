"""`python -m metaseq.cli.interactive_cli`: piped, on a terminal, and its one-line errors."""
import io
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from metaseq.cli import interactive_cli
from metaseq.file_io import atomic_torch_save
from metaseq.hub_utils import GenerationConfig, GeneratorInterface
from metaseq.models.partition import split_param
from metaseq.models.transformer_lm import ModelConfig, build_model
from metaseq.scripts.reshard_fsdp import reshard_fsdp_checkpoints
from test_hf_tokenizer import write_gpt2_files
from training import REPO, run_train

QUESTION = "what is the meaning of life?"
ANSWER = "To be happy."
# Measured: the default model reproduces the whole corpus after 100-150 such updates.
MEMORIZE_FLAGS = ["--batch-size", "16", "--seq-len", "64", "--lr", "1e-2"]
MEMORIZE_UPDATES = 150


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaseq.cli.interactive_cli", *args]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    """A tiny model trained (1 FSDP rank) until it reproduces the corpus, consolidated for serving."""
    save_dir = tmp_path_factory.mktemp("memorize")
    run_train(save_dir, world_size=1, max_update=MEMORIZE_UPDATES, extra=MEMORIZE_FLAGS)
    served = save_dir / "reshard-model_part-0.pt"
    reshard_fsdp_checkpoints(
        str(save_dir / "checkpoint_last-model_part-0-shard*.pt"), str(served),
        unflatten_weights=True, skip_optimizer_state=True,
    )
    return save_dir, served


def test_piped_question_prints_the_memorized_answer_and_exits(memorized):
    _, served = memorized
    proc = subprocess.run(_cli("--path", str(served)), input=QUESTION + "\n", capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ANSWER + "\n"
    assert "Traceback" not in proc.stderr


def test_each_nonempty_line_is_answered_until_eof(memorized, monkeypatch, capsys):
    _, served = memorized
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n\n   \nwhat do cats chase?\n"))
    assert interactive_cli.main(["--path", str(served)]) == 0
    assert capsys.readouterr().out.splitlines() == [ANSWER, "Mice."]


def test_sampling_flags_without_sampling_are_named_as_ignored(memorized, monkeypatch, capsys):
    _, served = memorized
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n"))
    assert interactive_cli.main(["--path", str(served), "--temperature", "0.5", "--seed", "7"]) == 0
    out, err = capsys.readouterr()
    assert out == ANSWER + "\n"  # the argmax
    assert "--temperature, --seed: ignored without --sampling (the argmax is taken); add --sampling" in err


def test_raw_shards_answer_like_the_consolidated_file(memorized, trained, monkeypatch, capsys):
    save_dir, _ = memorized
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))
    assert interactive_cli.main(["--path", str(save_dir / "checkpoint_last.pt")]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"
    # 4 shards of the (barely trained) shared run, consolidated in memory, as the library decodes them.
    four = trained[4][0]
    expected = GeneratorInterface.from_checkpoint(str(four / "checkpoint_last.pt")).generate(
        [QUESTION], GenerationConfig(max_new_tokens=12))[0].strip()
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))
    assert interactive_cli.main(["--path", str(four / "checkpoint_last-model_part-0-shard*.pt"), "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_flat_checkpoint_gives_one_line_error_not_traceback(memorized, tmp_path):
    save_dir, _ = memorized
    flat = tmp_path / "flat.pt"
    reshard_fsdp_checkpoints(str(save_dir / "checkpoint_last-model_part-0-shard*.pt"), str(flat))
    proc = subprocess.run(_cli("--path", str(flat)), input=QUESTION + "\n", capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode != 0
    assert proc.stdout == ""
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert "still flat" in err[0] and "flat_param_0" in err[0]
    assert "reshard_fsdp" in err[0] and "--unflatten-weights True" in err[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, culprit",
    [
        (["--path", "nowhere/checkpoint_last.pt"],
         "--path nowhere/checkpoint_last.pt: no such file, nor shards of a save by that name "
         "(nowhere/checkpoint_last-model_part-0-shard*.pt); pass a consolidated file"),
        (["--top-p", "1.5"], "--top-p=1.5 must be in (0, 1]"),
        (["--max-new-tokens", "abc"], "ERROR: argument --max-new-tokens: invalid int value: 'abc' (see --help)"),
        (["--sampling", "--temperature", "nan"], "--temperature=nan must be a finite number > 0"),
        (["--sampling", "--temperature", "inf"], "--temperature=inf must be a finite number > 0"),
        (["--sampling", "--temperature", "1e-39"], "--temperature=1e-39 must be from 1e-06 to 1e+06"),
        (["--sampling", "--temperature", "1e39"], "--temperature=1e+39 must be from 1e-06 to 1e+06"),
        (["--temperature", "0"], "it applies only with --sampling"),
        (["--sampling", "--seed", str(2**64)], f"--seed={2**64} does not fit in 64 bits; give one from -2**63 to"),
        (["--sampling", "--seed", str(-2**63 - 1)], "does not fit in 64 bits; give one from -2**63 to 2**64 - 1"),
        (["--path", "TMP/tensor.pt"], "TMP/tensor.pt: expected a checkpoint dict, found Tensor"),
        (["--path", "TMP/checkpoint_last.pt"], "TMP/checkpoint_last-model_part-0-shard1.pt is a broken symbolic link "
                                               "(to TMP/gone.pt, which does not exist); restore that file"),
        (["--path", "TMP/edited.pt"], "TMP/edited.pt: 'decoder.embed_positions.weight' is [69, 30] in the weights "
                                      "but [52, 30] in the model its config describes; its cfg['model'] does not "
                                      "describe these weights (edited?)"),
    ],
)
def test_bad_path_or_flag_is_one_line_error(memorized, args, culprit, capsys, tmp_path):
    atomic_torch_save(torch.zeros(3), tmp_path / "tensor.pt")
    atomic_torch_save(torch.zeros(3), tmp_path / "checkpoint_last-model_part-0-shard0.pt")
    os.symlink(tmp_path / "gone.pt", tmp_path / "checkpoint_last-model_part-0-shard1.pt")
    _save_model(tmp_path / "edited.pt")
    edited = torch.load(tmp_path / "edited.pt")
    edited["cfg"]["model"]["max_target_positions"] = 50
    atomic_torch_save(edited, tmp_path / "edited.pt")
    args, culprit = [a.replace("TMP", str(tmp_path)) for a in args], culprit.replace("TMP", str(tmp_path))
    args = args if "--path" in args else ["--path", str(memorized[1]), *args]
    assert interactive_cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0]


def test_too_long_prompt_is_reported_and_the_rest_answered(memorized, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x" * 100 + f"\n{QUESTION}\n"))
    assert interactive_cli.main(["--path", str(memorized[1])]) == 1
    captured = capsys.readouterr()
    assert captured.out == "\n" + ANSWER + "\n"  # each answer on its prompt's line
    assert "a prompt of 101 tokens does not fit" in captured.err


def test_prompt_that_is_not_utf8_is_reported_and_the_rest_answered(memorized):
    proc = subprocess.run(_cli("--path", str(memorized[1])), input=b"caf\xe9\n" + QUESTION.encode() + b"\n",
                          capture_output=True, env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 1 and proc.stdout.decode() == "\n" + ANSWER + "\n"
    err = proc.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "prompt 1 is not UTF-8 text" in err[0]


def _stopped_while_waiting(served, *signals: int) -> tuple[int, str]:
    """The CLI, piped, answers a question; then, waiting for the next line, gets `signals` one after the other.
    Returns its exit status and stderr."""
    proc = subprocess.Popen(_cli("--path", str(served)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        proc.stdin.write(QUESTION + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == ANSWER + "\n"  # loaded, answered, reading stdin again
        for signum in signals:
            proc.send_signal(signum)
        status = proc.wait(timeout=60)  # stdin stays open: only a signal ends it
    finally:
        proc.kill()
        proc.stdin.close()
    return status, proc.stderr.read()


def test_sigterm_is_one_line_not_a_silent_kill(memorized):
    status, err = _stopped_while_waiting(memorized[1], signal.SIGTERM)
    assert status == 2, err
    assert err.strip().splitlines()[-1] == "metaseq.cli.interactive_cli: ERROR: terminated by SIGTERM"
    assert "Traceback" not in err


def test_a_burst_of_ctrl_c_and_sigterm_ends_it_without_a_traceback(memorized):
    status, err = _stopped_while_waiting(memorized[1], signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT)
    assert "Traceback" not in err, err
    said = {130: "interrupted", 2: "terminated by SIGTERM"}  # the signals arrive together: either may be taken
    assert status in said, err
    assert err.count("ERROR") <= 1 and (f"ERROR: {said[status]}" in err or status == 130 and "ERROR" not in err)


def test_help_does_not_call_stopping_past_newlines_the_default():
    text = " ".join(interactive_cli.build_parser().format_help().split())
    assert "--no-stop-at-newline continue past newlines (an answer stops at the first newline by default)" in text
    assert "(default: True)" not in text
    assert interactive_cli.build_parser().parse_args(["--path", "x"]).stop_at_newline is True
    assert interactive_cli.build_parser().parse_args(["--path", "x", "--no-stop-at-newline"]).stop_at_newline is False


def _read_until(fd: int, seen: bytearray, done, timeout: float = 60.0) -> None:
    """Read the terminal into `seen` until `done(seen)`."""
    deadline = time.monotonic() + timeout
    while not done(bytes(seen)):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(f"timed out; the terminal shows {bytes(seen)!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            raise AssertionError(f"the terminal closed early; it shows {bytes(seen)!r}")
        seen += chunk


def test_terminal_session_shows_prompt_answers_and_exits_on_ctrl_d(memorized):
    master, slave = pty.openpty()
    proc = subprocess.Popen(_cli("--path", str(memorized[1])), stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                            env=_env(), cwd=REPO)
    os.close(slave)
    seen, answer = bytearray(), ANSWER.encode()
    try:
        _read_until(master, seen, lambda out: b"> " in out)
        os.write(master, f"\n{QUESTION}\n".encode())  # an empty line first: ignored
        # The answer, then a fresh prompt after it.
        _read_until(master, seen, lambda out: answer in out and b"> " in out[out.index(answer):])
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)
    assert bytes(seen).count(answer) == 1
    assert b"Traceback" not in proc.stderr.read()


def _save_model(path, **cfg):
    """A random default-size model (the byte tokenizer's 260 tokens) as a consolidated file."""
    atomic_torch_save({"model": build_model(ModelConfig(), seed=0).state_dict(),
                       "cfg": {"model": ModelConfig().to_dict(), **cfg}}, path)
    return str(path)


def test_one_model_parallel_part_is_refused_but_a_merged_file_that_keeps_p_in_cfg_is_served(tmp_path, capsys,
                                                                                           monkeypatch):
    """Part 0 of 2 holds half of each cut weight: refused, naming the '{j}' path and the merge. Upstream's merged
    restored.pt holds the whole model though its cfg still says model_parallel_size=2: served."""
    config = ModelConfig(decoder_attention_heads=2, decoder_ffn_embed_dim=76)
    whole = build_model(config, seed=0).state_dict()
    cfg = {"model": config.to_dict(), "common": {"model_parallel_size": 2}}
    part = tmp_path / "reshard-model_part-0.pt"
    atomic_torch_save({"model": {k: split_param(k, v, 2)[0].clone() for k, v in whole.items()}, "cfg": cfg}, part)
    assert interactive_cli.main(["--path", str(part)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_parallel_size=2" in err[0], err
    assert f"--path '{tmp_path}/reshard-model_part-{{j}}.pt'" in err[0] and "--num-output-parts 1" in err[0]
    atomic_torch_save({"model": whole, "cfg": cfg}, tmp_path / "restored.pt")
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))
    assert interactive_cli.main(["--path", str(tmp_path / "restored.pt"), "--max-new-tokens", "4"]) == 0
    assert "ERROR" not in capsys.readouterr().err


def test_tokenizer_with_more_ids_than_the_model_or_a_corrupt_one_is_refused(tmp_path, capsys):
    path = _save_model(tmp_path / "reshard-model_part-0.pt")
    vocab, merges, _ = write_gpt2_files(tmp_path)  # 300 ids
    assert interactive_cli.main(["--path", path, "--vocab-filename", vocab, "--merges-filename", merges]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 300 ids but the model's vocabulary only 260" in err[0], err
    (tmp_path / "badtok").mkdir()
    (tmp_path / "badtok" / "tokenizer.json").write_text('{"x":')
    assert interactive_cli.main(["--path", path, "--hf-tokenizer", str(tmp_path / "badtok")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--hf-tokenizer {tmp_path / 'badtok'}: cannot read" in err[0], err
