"""Training with tensor model parallelism (fairscale's layers, CPU/gloo): files, P-invariance, resume, errors."""
import logging
import subprocess
import sys

import pytest
import torch

from metaseq.cli import train
from metaseq.file_io import load_checkpoint
from metaseq.models.partition import merge_state_dicts, partition_dim, split_param, split_state_dict
from metaseq.models.transformer_lm import ModelConfig, build_model
from mp_harness import FIXED_TOKENS, MOMENTS, MP_MODEL_FLAGS, inspect_checkpoint, run_train_mp
from training import CORPUS, REPO, losses

UPDATES = 4
REL_TOL = 1e-4  # summation order differs between one matrix product and P partial ones
FLAT_KEYS = {"flat_param_0", "decoder.layers.0.flat_param_0", "decoder.layers.1.flat_param_0", "decoder.version"}


@pytest.fixture(scope="module")
def runs(mp_runs):
    """The session's model-parallel runs (conftest.py): shared with the resharding tests."""
    return mp_runs


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_p2_d2_training_writes_one_file_per_part_and_shard(runs):
    save_dir, _ = runs["p2"]
    names = sorted(p.name for p in save_dir.glob("checkpoint_last-*.pt"))
    assert names == [f"checkpoint_last-model_part-{j}-shard{i}.pt" for j in (0, 1) for i in (0, 1)]
    for j in (0, 1):
        for i in (0, 1):
            ckpt = load_checkpoint(save_dir / f"checkpoint_last-model_part-{j}-shard{i}.pt")
            cfg = ckpt["cfg"]
            assert cfg["common"]["model_parallel_size"] == 2
            assert cfg["distributed_training"]["distributed_world_size"] == 4
            assert cfg["distributed_training"]["distributed_rank"] == i * 2 + j  # fairscale's layout
            assert cfg["model"]["decoder_attention_heads"] == 2 and cfg["model"]["fused_qkv"] is False
            assert set(ckpt["model"]) == FLAT_KEYS
            meta = ckpt["shard_metadata"]["param_metadata"]
            root, layer = meta[0]["params"]["flat_param_0"], meta[1]["params"]["flat_param_0"]
            assert meta[0]["shared_param_info"] == [("decoder.embed_tokens.weight", "decoder.output_projection.weight")]
            shapes = dict(zip(root["names"], map(tuple, root["shapes"])))
            shapes.update(zip(layer["names"], map(tuple, layer["shapes"])))
            # This part's slices: vocab and columns split, rows of out_proj/fc2 split, the rest whole.
            assert shapes["decoder.embed_tokens.weight"] == (130, 30)
            assert shapes["decoder.embed_positions.weight"] == (69, 30)
            assert shapes["self_attn.q_proj.weight"] == (15, 30) and shapes["self_attn.q_proj.bias"] == (15,)
            assert shapes["self_attn.out_proj.weight"] == (30, 15) and shapes["self_attn.out_proj.bias"] == (30,)
            assert shapes["fc1.weight"] == (38, 30) and shapes["fc2.weight"] == (30, 38)
            # A layer's flat parameter has an odd length: shard 1 of every part is padded.
            assert layer["padding"] == (1 if i == 1 else 0)
            assert ckpt["optimizer_history"][-1]["num_updates"] == UPDATES


@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_losses_do_not_depend_on_model_parallel_size(runs, layout):
    suffix = "_fused" if layout == "fused" else ""
    base, parallel = runs["p1" + suffix][1], runs["p2" + suffix][1]
    assert sorted(base) == sorted(parallel) == list(range(1, UPDATES + 1))
    for update in base:
        assert _relative(parallel[update], base[update]) < REL_TOL, (update, parallel[update], base[update])
    assert base[UPDATES] < base[1]  # it does learn


def test_fused_and_separate_attention_start_as_the_same_model(runs):
    assert _relative(runs["p2_fused"][1][1], runs["p2"][1][1]) < REL_TOL


def test_resume_at_p2_from_its_own_shards_continues_the_run(runs, tmp_path):
    save_dir, uninterrupted = runs["p2"]
    proc = run_train_mp(tmp_path, model_parallel_size=2, world_size=4, max_update=UPDATES,
                        extra=["--restore-file", str(save_dir / "checkpoint_2.pt")])
    resumed = losses(proc)
    assert sorted(resumed) == [3, 4]
    for update in (3, 4):
        assert abs(resumed[update] - uninterrupted[update]) < 1e-6
    for path in save_dir.glob("checkpoint_last-*.pt"):
        a, b = load_checkpoint(path), load_checkpoint(tmp_path / path.name)
        for key in FLAT_KEYS:
            torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=1e-6)


def test_consolidated_part_files_restore_at_another_data_parallel_size(runs, tmp_path):
    save_dir, uninterrupted = runs["p2"]
    out = tmp_path / "consolidated"
    subprocess.run(
        [sys.executable, "-m", "metaseq.scripts.reshard_fsdp",
         "--input-glob-pattern", str(save_dir / "checkpoint_2-model_part-{j}-shard*.pt"),
         "--output-shard-name", str(out / "reshard-model_part-{j}.pt"),
         "--num-output-shards", "1", "--unflatten-weights", "True"],
        check=True, capture_output=True, cwd=REPO,
    )
    proc = run_train_mp(tmp_path / "resumed", model_parallel_size=2, world_size=2, max_update=UPDATES,
                        extra=["--restore-file", str(out / "reshard-model_part-1.pt")])
    resumed = losses(proc)
    assert sorted(resumed) == [3, 4]
    for update in (3, 4):
        assert abs(resumed[update] - uninterrupted[update]) < 1e-6
    # The harness loads consolidated parts as training does, and gives back what the files hold.
    seen = inspect_checkpoint(out / "reshard-model_part-0.pt", model_parallel_size=2, out_path=tmp_path / "seen.pt")
    files = [load_checkpoint(out / f"reshard-model_part-{j}.pt") for j in (0, 1)]
    expected = {"model": merge_state_dicts([f["model"] for f in files])}
    expected.update({key: merge_state_dicts([_consolidated_moments(f, key) for f in files]) for key in MOMENTS})
    for key, tensors in expected.items():
        for name, tensor in tensors.items():
            assert torch.equal(seen[key][name], tensor), (key, name)
    assert seen["step"] == 2


def _consolidated_moments(ckpt, key: str) -> dict:
    """{parameter name: moment} of fairscale's consolidated optimizer layout (ids in metadata order)."""
    names = [f"{m['fsdp_path']}.{n}".lstrip(".") for m in ckpt["shard_metadata"]["param_metadata"]
             for n in m["params"]["flat_param_0"]["names"]]
    return {names[i]: state[key] for i, state in ckpt["last_optimizer_state"]["state"].items()}


def test_harness_merges_parts_into_the_p1_model_and_moments(runs, tmp_path):
    """Merged P = 2 weights and Adam moments equal the P = 1 run's; logits of the parts equal the plain model's."""
    p2 = inspect_checkpoint(runs["p2"][0] / "checkpoint_last.pt", model_parallel_size=2,
                            out_path=tmp_path / "p2.pt", tokens=FIXED_TOKENS)
    p1 = inspect_checkpoint(runs["p1"][0] / "checkpoint_last.pt", model_parallel_size=1, out_path=tmp_path / "p1.pt")
    assert p2["step"] == p1["step"] == UPDATES
    assert set(p2["model"]) == set(build_model(ModelConfig.from_dict(p2["cfg_model"])).state_dict())
    for key in ("model", "exp_avg", "exp_avg_sq"):
        assert set(p2[key]) == set(p1[key])
        for name, tensor in p1[key].items():
            assert p2[key][name].shape == tensor.shape, (key, name)
            if name.endswith("k_proj.bias"):
                # Softmax ignores a shift of every key by the same q.b_k, so this gradient is 0 up to
                # rounding (~1e-11); Adam turns that noise into steps of its own, different for each P.
                assert float(tensor.abs().max()) < 1e-3 and float(p2[key][name].abs().max()) < 1e-3
                continue
            scale = float(tensor.abs().max()) or 1.0
            torch.testing.assert_close(p2[key][name], tensor, rtol=0, atol=1e-4 * scale, msg=f"{key} {name}")
    plain = build_model(ModelConfig.from_dict(p2["cfg_model"])).eval()
    plain.load_state_dict(p2["model"], strict=True)
    with torch.no_grad():
        torch.testing.assert_close(p2["logits"], plain(FIXED_TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "flags, culprit",
    [
        (["--world-size", "3", "--model-parallel-size", "2"], "--world-size=3 is not a multiple of --model-parallel-size=2"),
        (["--world-size", "2", "--model-parallel-size", "2", "--decoder-attention-heads", "3"],
         "--decoder-attention-heads=3 is not divisible by --model-parallel-size=2; model-parallel sizes this model allows: 1"),
        (["--world-size", "2", "--model-parallel-size", "2", "--decoder-attention-heads", "2", "--decoder-ffn-embed-dim", "71"],
         "--decoder-ffn-embed-dim=71 is not divisible by --model-parallel-size=2"),
        (["--world-size", "3", "--model-parallel-size", "3", "--decoder-attention-heads", "3", "--decoder-ffn-embed-dim", "72"],
         "vocab_size (the tokenizer's)=260 is not divisible by --model-parallel-size=3; model-parallel sizes this model allows: 1 "),
        (["--world-size", "4", "--model-parallel-size", "2", *MP_MODEL_FLAGS, "--batch-size", "5"],
         "--batch-size=5 is not divisible by the data-parallel size 2 (--world-size=4 / --model-parallel-size=2)"),
        (["--world-size", "2", "--model-parallel-size", "0"], "argument --model-parallel-size: must be at least 1, got 0"),
    ],
)
def test_bad_model_parallel_flags_give_one_line_error(tmp_path, caplog, flags, culprit):
    assert _main(tmp_path, flags, caplog) == 2
    assert culprit in caplog.text
    assert not list(tmp_path.glob("*.pt"))


def test_restore_with_other_model_parallel_size_names_reshard_model_parallel(runs, tmp_path, caplog):
    save_dir, _ = runs["p2"]
    flags = ["--world-size", "2", "--restore-file", str(save_dir / "checkpoint_last.pt")]
    assert _main(tmp_path, flags, caplog) == 2
    assert "the checkpoint has 2 model parts but --model-parallel-size=1" in caplog.text
    assert "python -m metaseq.scripts.reshard_model_parallel" in caplog.text


def test_restore_of_one_part_alone_is_refused_naming_the_parts(runs, tmp_path, caplog):
    """Part 0's files without part 1's hold half of each cut weight: refused at P=1 (was a traceback on every rank)
    and at P=2, before any rank starts."""
    save_dir, _ = runs["p2"]
    half = tmp_path / "half"
    half.mkdir()
    for path in save_dir.glob("checkpoint_last-model_part-0-shard*.pt"):
        (half / path.name).symlink_to(path)
    flags = ["--restore-file", str(half / "checkpoint_last.pt"), "--world-size", str(len(list(half.iterdir())))]
    assert _main(tmp_path / "p1", flags, caplog) == 2
    assert "is one of 2 model parts (cfg['common']['model_parallel_size'])" in caplog.text
    assert "--num-output-parts 1" in caplog.text and "Traceback" not in caplog.text
    caplog.clear()
    assert _main(tmp_path / "p2", [*flags[:2], "--world-size", "2", "--model-parallel-size", "2"], caplog) == 2
    assert "only model part(s) [0] are there but --model-parallel-size=2" in caplog.text


def test_restore_with_other_data_parallel_size_names_reshard_fsdp(runs, tmp_path, caplog):
    save_dir, _ = runs["p2"]
    flags = ["--world-size", "2", "--model-parallel-size", "2", "--restore-file", str(save_dir / "checkpoint_last.pt")]
    assert _main(tmp_path, flags, caplog) == 2
    assert "found 2 shard files of model part 0 but the data-parallel size is 1" in caplog.text
    assert "python -m metaseq.scripts.reshard_fsdp --input-glob-pattern" in caplog.text
    assert "--num-output-shards 1" in caplog.text


def test_consolidated_file_without_part_name_is_refused_at_p2(runs, tmp_path, caplog):
    single = tmp_path / "restored.pt"
    single.write_bytes((runs["p1"][0] / "checkpoint_last-model_part-0-shard0.pt").read_bytes())
    flags = ["--world-size", "2", "--model-parallel-size", "2", "--restore-file", str(single)]
    assert _main(tmp_path / "out", flags, caplog) == 2
    assert "a consolidated file holds one model part but --model-parallel-size=2" in caplog.text


def test_model_parallel_error_through_the_cli_is_one_line(tmp_path):
    proc = run_train_mp(tmp_path, model_parallel_size=2, world_size=3, max_update=1, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--world-size=3 is not a multiple of --model-parallel-size=2" in lines[0]
    assert "Traceback" not in proc.stderr


def _main(save_dir, flags, caplog) -> int:
    args = ["--data", str(CORPUS), "--save-dir", str(save_dir), "--max-update", "1", "--batch-size", "8",
            "--seq-len", "48", *flags]
    with caplog.at_level(logging.ERROR, logger="metaseq.cli.train"):
        return train.main(args)


# Pure partition rules (no processes).

def test_partition_rules_follow_upstream_metaseq():
    assert partition_dim("decoder.embed_tokens.weight") == 0
    assert partition_dim("decoder.output_projection.weight") == 0
    assert partition_dim("decoder.layers.3.self_attn.k_proj.bias") == 0
    assert partition_dim("decoder.layers.3.self_attn.qkv_proj.weight") == 0
    assert partition_dim("decoder.layers.3.fc1.weight") == 0
    assert partition_dim("decoder.layers.3.self_attn.out_proj.weight") == 1
    assert partition_dim("decoder.layers.3.fc2.weight") == 1
    for name in ("decoder.layers.3.fc2.bias", "decoder.layers.3.self_attn.out_proj.bias",
                 "decoder.embed_positions.weight", "decoder.layer_norm.weight", "decoder.version"):
        assert partition_dim(name) is None


def test_fused_qkv_part_holds_its_slice_of_each_block():
    d = 4
    q, k, v = (torch.full((d, 3), float(x)) + torch.arange(d).unsqueeze(1) / 10 for x in (1, 2, 3))
    parts = split_param("l.self_attn.qkv_proj.weight", torch.cat([q, k, v]), 2)
    torch.testing.assert_close(parts[1], torch.cat([q[2:], k[2:], v[2:]]))
    assert torch.equal(merge_state_dicts([{"l.self_attn.qkv_proj.weight": p} for p in parts])["l.self_attn.qkv_proj.weight"],
                       torch.cat([q, k, v]))


@pytest.mark.parametrize("fused", [False, True])
def test_split_then_merge_gives_the_plain_state_dict_back(fused):
    cfg = ModelConfig(decoder_attention_heads=2, decoder_ffn_embed_dim=76, fused_qkv=fused)
    state = build_model(cfg, seed=3).state_dict()
    parts = split_state_dict(state, 2)
    assert parts[0]["decoder.layers.0.fc2.weight"].shape == (30, 38)
    merged = merge_state_dicts(parts)
    assert list(merged) == list(state)
    for name in state:
        assert torch.equal(merged[name], state[name]), name


def test_merge_refuses_replicated_tensors_that_differ():
    a = {"decoder.layer_norm.weight": torch.ones(3)}
    b = {"decoder.layer_norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="replicated but part 1 differs"):
        merge_state_dicts([a, b])
