"""The reshard benchmark: synthetic checkpoints in the FORMAT.md layout, measurement, and the memory targets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

from metaseq.benchmark import runner, synth
from metaseq.benchmark.measure import run_measured
from metaseq.benchmark.reference import consolidate_flat_shards
from metaseq.file_io import load_checkpoint
from metaseq.models.transformer_lm import ModelConfig, build_model
from metaseq.scripts.benchmark_reshard import main as benchmark_main

REPO = Path(__file__).resolve().parents[1]
TOP_KEYS = {"model", "shard_metadata", "last_optimizer_state", "optimizer_history", "extra_state", "cfg"}
MEMORY_TEST_BYTES = 200_000_000


def _write(tmp_path: Path, size_bytes: int, world_size: int) -> synth.SyntheticCheckpoint:
    config = synth.plan_model_config(size_bytes, world_size)
    return synth.write_synthetic_checkpoint(tmp_path / f"w{world_size}", config, world_size)


def _unpad_cat(pieces: list[torch.Tensor], paddings: list[int]) -> torch.Tensor:
    return torch.cat([p[: p.numel() - pad] for p, pad in zip(pieces, paddings)])


def _backing(instance: dict) -> dict:
    return instance["params"]["flat_param_0"]


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory) -> tuple[synth.SyntheticCheckpoint, list[dict]]:
    ckpt = _write(tmp_path_factory.mktemp("synth"), 3_000_000, 3)
    return ckpt, [load_checkpoint(p) for p in ckpt.paths]


def test_synthetic_shards_have_format_keys_and_padding(three_shards):
    ckpt, shards = three_shards
    assert [p.name for p in ckpt.paths] == [f"checkpoint_last-model_part-0-shard{r}.pt" for r in range(3)]
    for rank, shard in enumerate(shards):
        assert set(shard) == TOP_KEYS
        assert shard["cfg"]["distributed_training"]["distributed_rank"] == rank
        assert shard["model"]["decoder.version"].tolist() == [3.0]
        assert shard["shard_metadata"]["buffer_names"] == ["decoder.version"]
    paddings = [[_backing(m)["padding"] for m in s["shard_metadata"]["param_metadata"]] for s in shards]
    assert any(p > 0 for rank_pads in paddings for p in rank_pads), f"no rank padded: {paddings}"
    root = shards[0]["shard_metadata"]["param_metadata"][0]
    assert root["fsdp_path"] == ""
    assert root["shared_param_info"] == [("decoder.embed_tokens.weight", "decoder.output_projection.weight")]


def test_synthetic_metadata_matches_the_real_model_and_agrees_across_ranks(three_shards):
    _, shards = three_shards
    config = ModelConfig.from_dict(shards[0]["cfg"]["model"])
    real = {n: p.shape for n, p in build_model(config).named_parameters()}  # tied weight once
    found = {}
    for instance in shards[0]["shard_metadata"]["param_metadata"]:
        meta = _backing(instance)
        prefix = instance["fsdp_path"] + "." if instance["fsdp_path"] else ""
        assert meta["numels"] == [s.numel() for s in meta["shapes"]]
        found.update({prefix + n: s for n, s in zip(meta["names"], meta["shapes"])})
    assert found == real
    strip = lambda s: [{**m, "params": {"flat_param_0": {**_backing(m), "padding": 0}}}  # noqa: E731
                       for m in s["shard_metadata"]["param_metadata"]]
    assert all(strip(s) == strip(shards[0]) for s in shards[1:])


def test_synthetic_shards_are_fairscales_split_of_one_full_tensor(three_shards):
    _, shards = three_shards
    instances = shards[0]["shard_metadata"]["param_metadata"]
    for k, instance in enumerate(instances):
        key = f"{instance['fsdp_path']}.flat_param_0" if instance["fsdp_path"] else "flat_param_0"
        paddings = [_backing(s["shard_metadata"]["param_metadata"][k])["padding"] for s in shards]
        pieces = {"param": [s["model"][key] for s in shards]}
        for moment in ("exp_avg", "exp_avg_sq"):
            pieces[moment] = [s["last_optimizer_state"]["state"][k][moment] for s in shards]
        for kind, per_rank in pieces.items():
            full = _unpad_cat(per_rank, paddings)
            assert full.numel() == sum(_backing(instance)["numels"]), (key, kind)
            for rank, piece in enumerate(per_rank):
                expected, pad = FSDP._get_shard(types.SimpleNamespace(world_size=3, rank=rank), full)
                assert pad == paddings[rank] and torch.equal(piece, expected), (key, kind, rank)


@pytest.mark.parametrize("size_bytes, world_size", [(4_000_000, 1), (10_000_000, 8), (12_000_000, 32)])
def test_synthetic_size_is_within_ten_percent_of_request(tmp_path, size_bytes, world_size):
    ckpt = _write(tmp_path, size_bytes, world_size)
    assert len(ckpt.paths) == world_size
    assert abs(ckpt.total_bytes - size_bytes) <= 0.1 * size_bytes, f"{ckpt.total_bytes} bytes for {size_bytes}"


def test_too_small_size_names_the_flag():
    with pytest.raises(ValueError, match="--size-gb"):
        synth.plan_model_config(100_000, 256)


def test_load_everything_reference_inverts_the_split(three_shards):
    _, shards = three_shards
    merged = consolidate_flat_shards(shards)
    key = "decoder.layers.0.flat_param_0"
    assert all(_backing(m)["padding"] == 0 for m in merged["shard_metadata"]["param_metadata"])
    for rank, shard in enumerate(shards):
        piece, _ = FSDP._get_shard(types.SimpleNamespace(world_size=3, rank=rank), merged["model"][key])
        assert torch.equal(piece, shard["model"][key])
        moment, _ = FSDP._get_shard(types.SimpleNamespace(world_size=3, rank=rank),
                                    merged["last_optimizer_state"]["state"][1]["exp_avg_sq"])
        assert torch.equal(moment, shard["last_optimizer_state"]["state"][1]["exp_avg_sq"])


def test_sampler_sums_memory_over_child_processes():
    child = "b = b'x' * (150 * 2**20); import time; time.sleep(0.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    m = run_measured([sys.executable, "-c", parent])
    assert m.returncode == 0
    assert m.peak_anon >= 150 * 2**20, f"peak anon {m.peak_anon / 2**20:.0f} MiB misses the child's 150 MiB"
    assert m.peak_rss >= m.peak_anon


def test_scenarios_parse_and_reject_bad_items():
    assert [s.name for s in runner.parse_scenarios("8-1, 16-3,8-1u")] == ["8-1", "16-3", "8-1u"]
    assert runner.parse_scenarios("256-1")[0].many_files
    for bad in ("8x1", "0-2", "8-2u", ""):
        with pytest.raises(ValueError, match="--scenarios"):
            runner.parse_scenarios(bad)


def test_memory_bound_counts_output_shard_largest_flat_and_slack():
    config = synth.model_config_for_width(8, layers=1)
    numels = [layout.numel for layout in synth.flat_layouts(config)]
    # root: embeddings (vocab 16*8+7, positions 2*8+5 plus OPT's 2 offset rows) and the final norm
    assert numels == [8 * (16 * 8 + 7) + 8 * (2 * 8 + 5 + 2) + 2 * 8, 12 * 8 * 8 + 19 * 8 + 3]
    shard = 3 * 4 * sum(-(-n // 3) for n in numels)  # param + two moments, ceil(n / 3) per rank
    assert runner.memory_bound(config, runner.Scenario(2, 3)) == shard + 4 * max(numels) + 256 * 2**20
    assert runner.memory_bound(config, runner.Scenario(2, 1, True)) == 3 * 4 * sum(numels) + 256 * 2**20


@pytest.mark.parametrize("argv, words", [
    (["--size-gb", "nan"], "argument --size-gb: must be a finite number > 0, got nan"),
    (["--size-gb", "0"], "argument --size-gb: must be a finite number > 0, got 0"),
    (["--size-gb", "2GB"], "argument --size-gb: must be a finite number > 0, got '2GB'"),  # no function name
    (["--timeout-s", "-3"], "argument --timeout-s: must be a finite number > 0"),
    (["--repeat", "0"], "argument --repeat: must be at least 1"),
    (["--plot-sizes", "1,0"], "--plot-sizes '1,0': expected positive GB sizes"),
    (["--out", "NOWHERE/results.json"], "--out NOWHERE/results.json: not a file in an existing folder"),
    (["--workdir", "FILE"], "--workdir FILE is a file; give a folder"),
    (["--out", "/proc/results.json"], "--out /proc/results.json: cannot write in /proc ("),  # not after the runs
    (["--workdir", "/proc/bench"], "--workdir /proc/bench: cannot create it ("),
])
def test_bad_flags_are_one_line_errors_before_anything_runs(tmp_path, capsys, argv, words):
    (tmp_path / "file").write_text("")
    names = {"NOWHERE": str(tmp_path / "nowhere"), "FILE": str(tmp_path / "file")}
    def named(text: str) -> str:
        return text.replace("NOWHERE", names["NOWHERE"]).replace("FILE", names["FILE"])

    assert benchmark_main(["--size-gb", "0.01", *map(named, argv)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ERROR: ") and named(words) in err


def test_a_scenario_that_failed_shows_no_figures():
    failed = runner.ScenarioResult("2x2-3x2", 4, 6, False, 10**7, 0, 0.1, 0.1, 0.1, 1.0, 1, 1, 1, returncode=2)
    row = runner.format_table([], [failed]).splitlines()[-1]
    assert row == "| 2x2-3x2 | 0.010 | failed (exit 2) |  |  |  |  |  |  |  | FAIL |"


def test_benchmark_cli_end_to_end_writes_json(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "metaseq.scripts.benchmark_reshard", "--size-gb", "0.01",
           "--scenarios", "2-3", "--out", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 2-3 |" in proc.stdout and "| load+save (2 in) |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["cache"] == "warm" and report["machine"]["cpus"] >= 1
    base = report["baselines"][0]
    assert base["inputs"] == 2 and base["load_save"]["seconds"] > 0 and base["copy"]["seconds"] > 0
    (result,) = report["scenarios"]
    expected = {"scenario", "seconds", "gb_per_s", "ratio_load_save", "ratio_copy", "peak_rss", "peak_anon",
                "memory_bound", "input_bytes", "output_bytes", "targets", "passed", "returncode"}
    assert expected <= set(result)
    assert result["scenario"] == "2-3" and result["returncode"] == 0 and result["output_bytes"] > 0
    assert abs(result["input_bytes"] - 10**7) <= 10**6
    assert set(result["targets"]) == {"memory", "vs_load_save", "vs_copy", "seconds"}
    assert result["ratio_load_save"] == pytest.approx(result["seconds"] / base["load_save"]["seconds"])
    assert not any((tmp_path / "work").iterdir()), "inputs and outputs should be deleted"


@pytest.fixture(scope="module")
def checkpoint_200mb(tmp_path_factory) -> synth.SyntheticCheckpoint:
    return _write(tmp_path_factory.mktemp("mem"), MEMORY_TEST_BYTES, 8)


@pytest.mark.parametrize("extra", [[], ["--output-dtype", "bf16"]], ids=["copy", "cast"])
@pytest.mark.parametrize("scenario", [runner.Scenario(8, 3), runner.Scenario(8, 1, unflatten=True)],
                         ids=lambda s: s.name)
def test_reshard_peak_anonymous_memory_is_within_bound(checkpoint_200mb, tmp_path, scenario, extra):
    """Flat: output shard + largest flat param + 256 MiB; unflattened: output + 256 MiB. Copying, and casting
    (which imports torch and casts a few MiB at a time)."""
    out = tmp_path / "out"
    os.sync()
    m = run_measured(runner.reshard_command(scenario, checkpoint_200mb.glob_pattern, out) + extra)
    assert m.returncode == 0, m.stderr_tail
    assert len(list(out.glob("out-shard*.pt"))) == scenario.outputs
    bound = runner.memory_bound(checkpoint_200mb.config, scenario)
    assert m.peak_anon <= bound, (
        f"{scenario.name} on {checkpoint_200mb.total_bytes / 1e6:.0f} MB: peak anonymous RSS "
        f"{m.peak_anon / 2**20:.0f} MiB exceeds the bound {bound / 2**20:.0f} MiB"
    )


def test_real_structured_synthetic_checkpoint_holds_upstream_objects(tmp_path):
    """--real-structured: Namespace cfg, int steps, loss_scale, 2 restarts, and rank 0's LockingArray
    pickled under upstream's module; the tensors are the default layout's, the size estimate holds."""
    import argparse

    from metaseq.benchmark.upstream_stubs import LockingArray, upstream_classes
    from metaseq.errors import CheckpointLoadError

    config = synth.model_config_for_width(8, layers=2)
    real = synth.write_synthetic_checkpoint(tmp_path / "real", config, 3, real_structured=True)
    default = synth.write_synthetic_checkpoint(tmp_path / "default", config, 3)
    with pytest.raises(CheckpointLoadError, match="document_to_sequence"):
        load_checkpoint(real.paths[0])  # an upstream class: refused by the safe loader
    with upstream_classes():
        shards = [torch.load(p, weights_only=False) for p in real.paths]
    for rank, (shard, plain) in enumerate(zip(shards, (load_checkpoint(p) for p in default.paths))):
        assert tuple(shard) == synth.UPSTREAM_KEYS and shard["criterion"] is None and shard["task_state"] == {}
        cfg = shard["cfg"]
        assert isinstance(cfg["model"], argparse.Namespace) and isinstance(cfg["criterion"], argparse.Namespace)
        assert not hasattr(cfg["model"], "vocab_size") and cfg["model"].decoder_embed_dim == 8
        assert cfg["distributed_training"]["distributed_rank"] == rank and "_name" in cfg["checkpoint"]
        assert [h["num_updates"] for h in shard["optimizer_history"]] == [synth.NUM_UPDATES // 2, synth.NUM_UPDATES]
        osd = shard["last_optimizer_state"]
        assert type(osd["loss_scale"]) is float and all(type(s["step"]) is int for s in osd["state"].values())
        cache = shard["extra_state"]["train_iterator"]["tokenization_cache"]
        if rank == 0:
            assert type(cache) is LockingArray and cache.data.size == synth.TOKENIZATION_CACHE_DOCUMENTS
        else:
            assert cache is None
        for key, tensor in plain["model"].items():
            assert torch.equal(shard["model"][key], tensor), key
        assert torch.equal(osd["state"][1]["exp_avg_sq"], plain["last_optimizer_state"]["state"][1]["exp_avg_sq"])
    estimate = synth.estimate_checkpoint_bytes(config, 3, real_structured=True)
    assert abs(real.total_bytes - estimate) <= 0.01 * real.total_bytes, (real.total_bytes, estimate)
    assert real.total_bytes > default.total_bytes + 4 * synth.TOKENIZATION_CACHE_DOCUMENTS
