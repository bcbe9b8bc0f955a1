"""`make demo` (python -m metaseq.scripts.demo): every step, end to end, on a smaller budget."""
import os
import subprocess
import sys

import pytest
import torch

from metaseq.file_io import load_checkpoint
from metaseq.scripts import demo
from training import REPO

SMALL_BUDGET = ["--updates", "100", "--round-updates", "25", "--max-update", "200"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo_out"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "metaseq.scripts.demo", "--out-dir", str(out), *SMALL_BUDGET],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    return out, proc


def test_demo_answers_the_question_after_4_to_1_reshard(demo_run):
    out, proc = demo_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line[:5] for line in lines if line.startswith("[")] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"]
    assert any("greedy decoding reproduces 16/16 corpus lines" in line for line in lines)
    asked = lines.index("  > what is the meaning of life?")
    assert lines[asked + 1] == "  To be happy."
    assert (out / "reshard_1" / "reshard-model_part-0.pt").is_file()
    assert "Traceback" not in proc.stderr


def test_demo_runs_the_real_clis(demo_run):
    _, proc = demo_run
    commands = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith(("$", "$ echo"))]
    assert any(c.startswith("$ python -m metaseq.cli.train") and "--world-size 4" in c for c in commands)
    assert any(c.startswith("$ python -m metaseq.scripts.reshard_fsdp") and "--unflatten-weights True" in c
               and "--num-output-shards 1" in c for c in commands)
    assert any(c.startswith("$ echo") and "| python -m metaseq.cli.interactive_cli --path" in c for c in commands)
    assert sum("--num-output-shards 8" in c for c in commands) == 1


def test_demo_round_trips_4_8_4_and_resumes_with_equal_loss(demo_run):
    out, proc = demo_run
    assert len(list((out / "reshard_8").glob("checkpoint_last-model_part-0-shard*.pt"))) == 8
    assert len(list((out / "reshard_8_4").glob("checkpoint_last-model_part-0-shard*.pt"))) == 4
    eight = load_checkpoint(out / "reshard_8" / "checkpoint_last-model_part-0-shard7.pt")
    assert eight["last_optimizer_state"]["state"][0]["exp_avg"].numel() > 0  # optimizer state kept
    assert "back bit for bit" in proc.stdout
    resumed = [line for line in proc.stdout.splitlines() if "resumed," in line]
    assert len(resumed) == 2 and all(line.endswith(": equal") for line in resumed)
    assert len(list((out / "resumed").glob("checkpoint_last-model_part-0-shard*.pt"))) == 4


def test_demo_names_its_folder_at_the_end(demo_run):
    out, proc = demo_run
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done in ") and last.endswith(f"everything is under {out}/")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(demo.SUBDIRS)


def test_demo_refuses_a_foreign_out_dir(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert demo.main(["--out-dir", str(tmp_path)]) == 2
    assert "was not made by this demo" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["precious.txt"]
    for out in (tmp_path / "precious.txt", tmp_path / "precious.txt" / "sub"):  # a file on the way: no traceback
        assert demo.main(["--out-dir", str(out)]) == 2
        assert f"error: --out-dir {out}: cannot make it a folder (Not a directory)" in capsys.readouterr().err


def test_demo_clears_only_its_own_folders_on_rerun(tmp_path):
    (tmp_path / demo.MARKER).touch()
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "stale.pt").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    demo.prepare_out_dir(tmp_path)
    assert not (tmp_path / "train").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flags, culprit", [(["--updates", "2"], "--updates=2"), (["--max-update", "50"], "--max-update=50")])
def test_demo_bad_budget_is_one_line_error(tmp_path, flags, culprit, capsys):
    assert demo.main(["--out-dir", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0]


def test_corpus_pairs_split_at_the_question_mark():
    assert demo.corpus_pairs(["what is the meaning of life? To be happy.", "no question here"]) == [
        ("what is the meaning of life?", "To be happy."),
        ("no", "question here"),
    ]


def test_tensor_mismatches_finds_a_changed_moment():
    a = {"model": {"w": torch.ones(3)}, "opt": {"state": {0: {"exp_avg": torch.zeros(2), "step": 3}}}}
    b = {"model": {"w": torch.ones(3)}, "opt": {"state": {0: {"exp_avg": torch.tensor([0.0, 1e-9]), "step": 3}}}}
    assert demo.tensor_mismatches(a, a) == []
    assert demo.tensor_mismatches(a, b) == ["/opt/state/0/exp_avg"]
