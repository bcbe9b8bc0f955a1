"""The upstream-structured fixture (tests/real_metaseq.py) itself: fields, types and dtypes of real
metaseq OPT shards, checked against what fairscale and torch reported while writing them."""
from __future__ import annotations

import argparse
import pickle
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from metaseq.models.transformer_lm import ModelConfig
from real_metaseq import (
    EMA_KEYS,
    FP16_MAX,
    LOSS_SCALE,
    REPORT,
    RESTORED,
    UPSTREAM_MODULE,
    LockingArray,
    RealRunSpec,
    expected_tokenization_cache,
    load_real,
    model_config,
    train_iterator_state,
    upstream_classes,
    upstream_optimizer_state,
    write_real_runs,
)

TOP_KEYS = ["cfg", "model", "criterion", "optimizer_history", "task_state", "extra_state",
            "last_optimizer_state", "shard_metadata"]
UPDATES = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[Path], list[dict]]]:
    """Two runs on one spawn of 2 ranks: "run" (P = 1, W = 2, everything on) and "mp_run" (P = 2
    model parts of W = 1 shard, no EMA, fp32 moments); {name: (folder, paths, loaded shards)}."""
    specs = {"run": RealRunSpec(2, ema=True, fp16_adam_stats=True, streaming=True, updates=UPDATES, restored=True,
                                report=True),
             "mp_run": RealRunSpec(1, model_parallel_size=2, ema=False, updates=1, restored=True)}
    folders = {name: tmp_path_factory.mktemp(name) for name in specs}
    written = write_real_runs([(folders[name], spec) for name, spec in specs.items()])
    return {name: (folders[name], paths, [load_real(p) for p in paths]) for name, paths in zip(specs, written)}


@pytest.fixture(scope="module")
def run(runs) -> tuple[Path, list[Path], list[dict], list[dict]]:
    """P = 1, W = 2: (folder, paths, loaded shards, fairscale's report per rank)."""
    folder, paths, shards = runs["run"]
    return folder, paths, shards, torch.load(folder / REPORT, weights_only=False)


@pytest.fixture(scope="module")
def mp_run(runs) -> tuple[Path, list[Path], list[dict]]:
    return runs["mp_run"]


def _walk(obj):
    yield obj
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v)


def _flat_keys(ckpt: dict) -> list[str]:
    return [k for k in ckpt["model"] if k.endswith("flat_param_0")]


def test_files_and_top_level_keys_are_upstreams(run, mp_run):
    _, paths, shards, _ = run
    assert [p.name for p in paths] == [f"checkpoint_last-model_part-0-shard{i}.pt" for i in range(2)]
    assert [p.name for p in mp_run[1]] == [f"checkpoint_last-model_part-{j}-shard0.pt" for j in range(2)]
    for ckpt in shards + mp_run[2]:
        assert list(ckpt) == TOP_KEYS
        assert ckpt["criterion"] is None and ckpt["task_state"] == {}
        history = ckpt["optimizer_history"]
        steps = {s["step"] for s in ckpt["last_optimizer_state"]["state"].values()}
        assert len(history) == 2 and [h["num_updates"] for h in history] == [min(steps) // 2, min(steps)] == \
            [max(steps) // 2, max(steps)]
        assert all(set(h) == {"criterion_name", "optimizer_name", "lr_scheduler_state", "num_updates"} for h in history)
        assert history[-1]["optimizer_name"] == "MemoryEfficientFP16Optimizer"
    assert mp_run[2][0]["optimizer_history"][-1]["criterion_name"] == "VocabParallelCrossEntropyCriterion"


def test_cfg_is_a_plain_dict_with_namespace_model_and_per_rank_fields(run, mp_run):
    for ckpts, parts, world in ((run[2], 1, 2), (mp_run[2], 2, 1)):
        for index, ckpt in enumerate(ckpts):
            cfg = ckpt["cfg"]
            assert type(cfg) is dict
            assert isinstance(cfg["model"], argparse.Namespace) and isinstance(cfg["criterion"], argparse.Namespace)
            assert cfg["model"]._name == "transformer_lm_megatron" and not hasattr(cfg["model"], "vocab_size")
            sections = [v for v in cfg.values() if isinstance(v, (dict, argparse.Namespace))]
            assert len(sections) >= 10 and all("_name" in vars(s) if isinstance(s, argparse.Namespace) else "_name" in s
                                               for s in sections)
            part, shard = divmod(index, world)
            dt = cfg["distributed_training"]
            assert dt["distributed_rank"] == shard * parts + part and dt["device_id"] == dt["distributed_rank"]
            assert dt["distributed_world_size"] == parts * world and dt["use_sharded_state"] is True
            assert cfg["checkpoint"]["checkpoint_suffix"] == f"-model_part-{part}"
            assert cfg["common"]["model_parallel_size"] == parts and cfg["common"]["memory_efficient_fp16"]
            assert ModelConfig.from_dict(cfg["model"]) == model_config(parts)  # rebuilds the trained model


def test_model_is_fp16_and_metadata_is_fairscales_with_tuple_shapes(run):
    _, _, shards, report = run
    for ckpt, rank_report in zip(shards, report):
        assert list(ckpt["model"]) == list(rank_report["model"])
        for key, tensor in ckpt["model"].items():
            assert tensor.dtype == torch.float16, key
            assert torch.equal(tensor, rank_report["model"][key].half()), key
        assert not any(isinstance(x, torch.Size) for x in _walk(ckpt)), "torch.Size left in the file"
        shapes = [s for m in ckpt["shard_metadata"]["param_metadata"] for s in m["params"]["flat_param_0"]["shapes"]]
        assert shapes and all(type(s) is tuple for s in shapes)
        as_fairscale = _sizes_to_tuples(rank_report["metadata"])
        assert ckpt["shard_metadata"] == as_fairscale
        assert _sizes_to_tuples(rank_report["reloaded"]["metadata"]) == as_fairscale  # a fresh FSDP model agrees
        for key, tensor in ckpt["model"].items():
            assert torch.equal(rank_report["reloaded"]["model"][key], tensor.float()), key
    paddings = [m["params"]["flat_param_0"]["padding"] for s in shards for m in s["shard_metadata"]["param_metadata"]]
    assert any(paddings), f"fairscale padded nothing: {paddings}"


def _sizes_to_tuples(obj):
    if isinstance(obj, dict):
        return {k: _sizes_to_tuples(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_sizes_to_tuples(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_sizes_to_tuples(v) for v in obj)
    return obj


def test_fp16_adam_stats_are_scaled_per_rank(run):
    _, _, shards, report = run
    for ckpt, rank_report in zip(shards, report):
        osd = ckpt["last_optimizer_state"]
        assert osd["loss_scale"] == LOSS_SCALE and type(osd["loss_scale"]) is float
        assert osd["param_groups"][0]["betas"] == (0.9, 0.95) and type(osd["param_groups"][0]["betas"]) is tuple
        lengths = [ckpt["model"][k].numel() for k in _flat_keys(ckpt)]
        for k, state in osd["state"].items():
            assert list(state) == ["step", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"]
            assert type(state["step"]) is int and state["step"] == UPDATES
            for name in ("exp_avg", "exp_avg_sq"):
                moment, scale = state[name], state[f"{name}_scale"]
                assert moment.dtype == torch.float16 and moment.numel() == lengths[k]
                assert scale.dim() == 0 and scale.dtype == torch.float32
                true = rank_report["optimizer"]["state"][k][name]
                assert float(scale) == pytest.approx(1e-8 + float(true.abs().max()) / FP16_MAX, rel=1e-6)
                assert torch.allclose(moment.float() * scale, true, rtol=1e-3, atol=float(scale)), (k, name)
    for k in shards[0]["last_optimizer_state"]["state"]:
        scales = [float(s["last_optimizer_state"]["state"][k]["exp_avg_scale"]) for s in shards]
        assert scales[0] != scales[1], f"state {k}: both ranks have exp_avg_scale {scales[0]}"


def test_fp32_moments_without_fp16_stats(run, mp_run):
    raw = run[3][1]["optimizer"]
    shaped = upstream_optimizer_state(raw, fp16_adam_stats=False)
    for k, state in shaped["state"].items():
        assert list(state) == ["step", "exp_avg", "exp_avg_sq"] and type(state["step"]) is int
        assert torch.equal(state["exp_avg_sq"], raw["state"][k]["exp_avg_sq"])
        assert state["exp_avg"].dtype == torch.float32
    assert set(shaped["param_groups"][0]) == {"lr", "bias_correction", "betas", "eps", "weight_decay",
                                              "max_grad_norm", "params"}
    for ckpt in mp_run[2]:
        assert all(s["exp_avg"].dtype == torch.float32 and s["step"] == 1
                   for s in ckpt["last_optimizer_state"]["state"].values())


def test_ema_shards_are_laid_out_like_the_model(run, mp_run):
    _, _, shards, _ = run
    for ckpt in shards:
        ema, ema32 = (ckpt["extra_state"][k] for k in EMA_KEYS)
        assert list(ema) == list(ckpt["model"]) == list(ema32)
        pads = {(m["fsdp_path"] + "." if m["fsdp_path"] else "") + "flat_param_0": m["params"]["flat_param_0"]["padding"]
                for m in ckpt["shard_metadata"]["param_metadata"]}
        for key in _flat_keys(ckpt):
            assert ema[key].dtype == torch.float16 and ema32[key].dtype == torch.float32
            assert ema[key].shape == ckpt["model"][key].shape == ema32[key].shape
            assert torch.equal(ema32[key].half(), ema[key])
            assert not torch.equal(ema[key], ckpt["model"][key]), f"{key}: EMA equals the model"
            if pads[key]:
                assert not ema32[key][-pads[key]:].any(), f"{key}: padding of {pads[key]} is not zeros"
    assert not any(k in ckpt["extra_state"] for ckpt in mp_run[2] for k in EMA_KEYS)


def test_extra_state_metrics_iterator_and_tokenization_cache(run, mp_run):
    _, paths, shards, _ = run
    for rank, ckpt in enumerate(shards):
        extra = ckpt["extra_state"]
        loss_meter = next(m for m in extra["metrics"]["train"] if m[1] == "loss")
        assert loss_meter[2] == "AverageMeter" and loss_meter[3]["val"].dim() == 0
        assert type(extra["previous_training_time"]) is float and type(extra["ewm_loss"]) is float
        iterator = extra["train_iterator"]
        assert set(iterator) == {"epoch", "sequences_consumed", "tokenization_cache", "n"}
        cache = iterator["tokenization_cache"]
        assert (cache == expected_tokenization_cache(0)) if rank == 0 else cache is None
        assert "rng_tracker_states" not in extra
    assert type(shards[0]["extra_state"]["train_iterator"]["tokenization_cache"]) is LockingArray
    globals_in = [_pickled_globals(p) for p in paths]
    assert (UPSTREAM_MODULE, "LockingArray") in globals_in[0]
    assert (UPSTREAM_MODULE, "LockingArray") not in globals_in[1]
    caches = [ckpt["extra_state"]["train_iterator"]["tokenization_cache"] for ckpt in mp_run[2]]
    assert caches[0] == expected_tokenization_cache(0) and caches[1] is None  # part 1's shard 0 is global rank 1
    assert train_iterator_state(RealRunSpec(2, streaming=False, updates=3), 0) == {
        "version": 2, "epoch": 1, "iterations_in_epoch": 3, "shuffle": True}


def _pickled_globals(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every GLOBAL opcode in the file's pickle (torch.save uses protocol 2)."""
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    import pickletools
    return {tuple(arg.split(" ", 1)) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_tokenization_cache_needs_the_stand_in_module(run):
    path = run[1][0]
    assert UPSTREAM_MODULE not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="metaseq.data.document_to_sequence"):
        torch.load(path, weights_only=False)
    with upstream_classes():
        again = pickle.loads(pickle.dumps(expected_tokenization_cache(3)))
    assert UPSTREAM_MODULE not in sys.modules
    assert again == expected_tokenization_cache(3) and again != expected_tokenization_cache(4)
    assert again.data.dtype == np.int32 and again.num_workers == 2


def test_rng_tracker_states_differ_per_rank_with_model_parallelism(mp_run):
    states = [ckpt["extra_state"]["rng_tracker_states"] for ckpt in mp_run[2]]
    for s in states:
        assert list(s) == ["model-parallel-rng"] and s["model-parallel-rng"].dtype == torch.uint8
    assert not torch.equal(states[0]["model-parallel-rng"], states[1]["model-parallel-rng"])


@pytest.mark.parametrize("which", ["run", "mp_run"])
def test_restored_is_unflattened_with_a_dictconfig(which, request):
    from omegaconf import DictConfig, OmegaConf

    folder, _, shards = request.getfixturevalue(which)[:3]
    restored = load_real(folder / RESTORED)
    assert isinstance(restored["cfg"], DictConfig) and OmegaConf.is_struct(restored["cfg"])
    assert isinstance(restored["cfg"].model, argparse.Namespace) and restored["cfg"].model.arch == "transformer_lm"
    assert "last_optimizer_state" not in restored and "shard_metadata" not in restored
    assert not any(k in restored["extra_state"] for k in EMA_KEYS)
    params = restored["model"]
    assert "decoder.output_projection.weight" not in params and "decoder.version" not in params
    assert all(v.dtype == torch.float16 for v in params.values())
    if which == "run":  # W = 2 shards of one part: unpad and concatenate, then split by the metadata
        _assert_shards_unflatten_to(shards, params)


def _assert_shards_unflatten_to(shards: list[dict], params: dict[str, torch.Tensor]) -> None:
    for idx, meta in enumerate(shards[0]["shard_metadata"]["param_metadata"]):
        key = (meta["fsdp_path"] + "." if meta["fsdp_path"] else "") + "flat_param_0"
        pieces = []
        for s in shards:
            pad = s["shard_metadata"]["param_metadata"][idx]["params"]["flat_param_0"]["padding"]
            pieces.append(s["model"][key][: s["model"][key].numel() - pad])
        full = torch.cat(pieces)
        backing = meta["params"]["flat_param_0"]
        for name, shape, chunk in zip(backing["names"], backing["shapes"], full.split(backing["numels"])):
            full_name = f"{meta['fsdp_path']}.{name}" if meta["fsdp_path"] else name
            assert torch.equal(params[full_name], chunk.view(shape)), full_name
