"""The reshard tool against real fairscale FSDP on CPU (checkpoints from the training CLI)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import TRAIN_UPDATES
from fsdp_harness import run_on_ranks, save_full_state_dict
from metaseq.file_io import load_checkpoint
from metaseq.scripts.reshard_fsdp import main as reshard_main
from training import losses, run_train

SHARD = "checkpoint_{tag}-model_part-0-shard{{i}}.pt"


def _reshard(inputs, output, m, *flags):
    rc = reshard_main([
        "--input-glob-pattern", str(inputs), "--output-shard-name", str(output),
        "--num-output-shards", str(m), "--quiet", *flags,
    ])
    assert rc == 0


def _resume(tmp_path, restore_file, world_size):
    proc = run_train(tmp_path / f"resumed_w{world_size}", world_size=world_size, max_update=TRAIN_UPDATES,
                     extra=["--restore-file", str(restore_file)])
    return losses(proc)


def test_unflattened_output_equals_fsdp_full_state_dict(trained, tmp_path):
    save_dir, _ = trained[4]
    pattern = str(save_dir / SHARD.format(tag="last"))
    oracle_path = tmp_path / "fsdp_state_dict.pt"
    run_on_ranks(save_full_state_dict, 4, pattern, str(oracle_path))
    oracle = torch.load(oracle_path, weights_only=True)

    out = tmp_path / "reshard-model_part-0.pt"
    _reshard(save_dir / "checkpoint_last-model_part-0-shard*.pt", out, 1,
             "--unflatten-weights", "True", "--skip-optimizer-state", "True")
    consolidated = load_checkpoint(out)["model"]

    assert set(consolidated) == set(oracle)
    assert "decoder.output_projection.weight" in consolidated and "decoder.version" in consolidated
    for key, value in oracle.items():
        assert consolidated[key].shape == value.shape, key
        assert torch.equal(consolidated[key], value), key


@pytest.mark.parametrize("m", [2, 8])
def test_flat_reshard_resumes_like_continuing_at_n(trained, tmp_path, m):
    save_dir, uninterrupted = trained[4]
    out = tmp_path / "resharded" / SHARD.format(tag="4")
    _reshard(save_dir / "checkpoint_4-model_part-0-shard*.pt", out, m)
    resumed = _resume(tmp_path, tmp_path / "resharded" / "checkpoint_4.pt", m)
    assert sorted(resumed) == [5, 6]
    for update in (5, 6):
        assert abs(resumed[update] - uninterrupted[update]) < 1e-5, (update, resumed, uninterrupted)
    _assert_same_parameters(tmp_path, save_dir, 4, tmp_path / f"resumed_w{m}", m)


def test_consolidated_optimizer_state_resumes_through_get_shard_from_optim_state_dict(trained, tmp_path):
    save_dir, uninterrupted = trained[4]
    consolidated = tmp_path / "reshard-model_part-0.pt"
    _reshard(save_dir / "checkpoint_4-model_part-0-shard*.pt", consolidated, 1, "--unflatten-weights")
    osd = load_checkpoint(consolidated)["last_optimizer_state"]
    assert {"state", "param_groups", "param_id_map", "uncollected_local_ids"} <= set(osd)
    resumed = _resume(tmp_path, consolidated, 2)
    assert sorted(resumed) == [5, 6]
    for update in (5, 6):
        assert abs(resumed[update] - uninterrupted[update]) < 1e-5, (update, resumed, uninterrupted)
    _assert_same_parameters(tmp_path, save_dir, 4, tmp_path / "resumed_w2", 2)


def _assert_same_parameters(tmp_path, dir_a, n_a, dir_b, n_b):
    """Consolidate both final checkpoints and compare every parameter."""
    full = []
    for d, n in ((dir_a, n_a), (dir_b, n_b)):
        out = tmp_path / f"final_{n}_{len(full)}.pt"
        _reshard(d / "checkpoint_last-model_part-0-shard*.pt", out, 1, "--unflatten-weights", "--skip-optimizer-state")
        full.append(load_checkpoint(out)["model"])
    assert set(full[0]) == set(full[1])
    for key in full[0]:
        # k_proj.bias has an exactly-zero gradient (softmax ignores a per-query shift), so
        # Adam normalizes pure rounding noise, which differs with the reduction order of W.
        atol = 1e-5 if key.endswith("k_proj.bias") else 1e-6
        torch.testing.assert_close(full[0][key], full[1][key], rtol=0, atol=atol, msg=key)


def _python_m_reshard(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "metaseq.scripts.reshard_fsdp", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_seed_commands_run_verbatim_through_python_m(trained, tmp_path):
    save_dir, _ = trained[1]
    # A 256-shard version of the trained model, then the seed's 256 -> 1 -> 256 with optimizer state.
    _python_m_reshard("--input-glob-pattern", save_dir / "checkpoint_last-model_part-0-shard*.pt",
                      "--output-shard-name", tmp_path / "ckpts" / SHARD.format(tag="last"), "--num-output-shards", 256)
    _python_m_reshard("--input-glob-pattern", tmp_path / "ckpts" / "checkpoint_last-model_part-0-shard*.pt",
                      "--output-shard-name", tmp_path / "one" / "reshard-model_part-0.pt",
                      "--num-output-shards", 1, "--skip-optimizer-state", "False")
    _python_m_reshard("--input-glob-pattern", tmp_path / "one" / "reshard-model_part-0.pt",
                      "--output-shard-name", tmp_path / "back" / SHARD.format(tag="last"),
                      "--num-output-shards", 256, "--skip-optimizer-state", "False")
    for r in (0, 1, 100, 255):
        a = load_checkpoint(tmp_path / "ckpts" / SHARD.format(tag="last").format(i=r))
        b = load_checkpoint(tmp_path / "back" / SHARD.format(tag="last").format(i=r))
        assert a["shard_metadata"] == b["shard_metadata"]
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key])
        for k, state in a["last_optimizer_state"]["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["last_optimizer_state"]["state"][k][name]))

    # The seed's consolidation command, verbatim flags, 4 -> 1 unflattened.
    save4, _ = trained[4]
    os.symlink(save4, tmp_path / "ckpts4")
    proc = subprocess.run(
        [sys.executable, "-m", "metaseq.scripts.reshard_fsdp",
         "--input-glob-pattern", "ckpts4/checkpoint_last-model_part-0-shard*.pt",
         "--output-shard-name", "out/reshard-model_part-0.pt",
         "--num-output-shards", "1", "--skip-optimizer-state", "True", "--unflatten-weights", "True"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    model = load_checkpoint(tmp_path / "out" / "reshard-model_part-0.pt")["model"]
    assert model["decoder.embed_tokens.weight"].shape == (260, 30)
    assert torch.equal(model["decoder.embed_tokens.weight"], model["decoder.output_projection.weight"])


def test_outputs_keep_the_module_versions_and_say_their_own_rank(trained, tmp_path, capsys):
    """Flat outputs keep the state dict's OrderedDict and `_metadata`; each cfg names the output's rank and world
    size, so a shard copied over another is caught when the outputs are read back."""
    save_dir, _ = trained[4]
    out = tmp_path / "o" / "checkpoint_last-model_part-0-shard{i}.pt"
    _reshard(save_dir / "checkpoint_last-model_part-0-shard*.pt", out, 3)
    want = load_checkpoint(save_dir / "checkpoint_last-model_part-0-shard0.pt")["model"]
    for rank in range(3):
        got = load_checkpoint(str(out).format(i=rank))
        assert type(got["model"]) is type(want) and got["model"]._metadata == want._metadata
        assert (got["cfg"]["distributed_training"]["distributed_rank"],
                got["cfg"]["distributed_training"]["distributed_world_size"]) == (rank, 3)
    shutil.copy(str(out).format(i=0), str(out).format(i=1))  # of the same length
    assert reshard_main(["--input", str(tmp_path / "o" / "*.pt"), "--output", str(tmp_path / "x.pt"),
                         "--unflatten-weights", "--quiet"]) == 2
    assert "were both saved by rank 0 (their cfg's distributed_rank)" in capsys.readouterr().err
