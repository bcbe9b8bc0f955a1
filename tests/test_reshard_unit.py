"""Pure unit tests of the reshard logic on synthetic shards (no files)."""
from __future__ import annotations

import copy
import os
import re
import types
from pathlib import Path

import pytest
import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.data_parallel.fsdp_optim_utils import flatten_optim_state_dict

from metaseq.reshard import ReshardError, ReshardOptions, reshard_shards
from metaseq.reshard.plan import InputFile, plan_structures
from metaseq.reshard.ranges import Span, plan_range, shard_range
from metaseq.torchzip import from_torch
from synthetic import INSTANCES, LOSS_SCALE, STEP, assert_tree_equal, join, make_model, make_shards, shard_flat

WORLD_SIZES = [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2), (4, 8), (8, 4), (5, 7)]
RANK_SPECIFIC = ("cfg", "extra_state")  # outputs take rank 0's


def consolidate(shards: list[dict], *, skip_optimizer_state: bool = True) -> dict:
    """All shards as one unflattened checkpoint (as `--unflatten-weights` writes it)."""
    return reshard_shards(shards, unflatten_weights=True, skip_optimizer_state=skip_optimizer_state)[0]


def _without_rank_specific(shard: dict) -> dict:
    return {k: v for k, v in shard.items() if k not in RANK_SPECIFIC}


def _flat_keys() -> list[str]:
    return [join(path, "flat_param_0") for path, _, _ in INSTANCES]


# --- how a flat parameter is split ------------------------------------------------------------


@pytest.mark.parametrize("numel", [0, 1, 3, 7, 12, 27, 38])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8, 9])
def test_shard_range_matches_fairscale_get_shard(numel: int, world_size: int) -> None:
    flat = torch.arange(numel, dtype=torch.float32)
    for rank in range(world_size):
        expected, expected_pad = shard_flat(flat, world_size, rank)
        start, end, padded_len = shard_range(numel, world_size, rank)
        assert padded_len == expected.numel()
        assert padded_len - (end - start) == expected_pad
        assert torch.equal(flat[start:end], expected[: end - start])


def test_plan_range_spans_segment_boundaries() -> None:
    spans = [Span(0, ("a",), 0, 4), Span(1, ("b",), 0, 0), Span(2, ("c",), 10, 5)]
    runs = plan_range(spans, 2, 7, offset=1)
    assert [(r.input, r.start, r.offset, r.length) for r in runs] == [(0, 2, 1, 2), (2, 10, 3, 3)]


# --- N -> M -> N ------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", WORLD_SIZES)
def test_reshard_and_back_is_bit_exact(n: int, m: int) -> None:
    shards = make_shards(make_model(), n)
    back = reshard_shards(reshard_shards(shards, num_output_shards=m), num_output_shards=n)
    assert len(back) == n
    for rank, (got, want) in enumerate(zip(back, shards)):
        assert_tree_equal(_without_rank_specific(got), _without_rank_specific(want), f"rank {rank}")
        assert got["cfg"] == want["cfg"]  # its own rank and world size


@pytest.mark.parametrize("n, m", WORLD_SIZES)
def test_output_shards_equal_fairscale_sharding_of_full_params(n: int, m: int) -> None:
    model = make_model(seed=1)
    outs = reshard_shards(make_shards(model, n), num_output_shards=m)
    direct = make_shards(model, m)
    assert len(outs) == m
    for rank, (got, want) in enumerate(zip(outs, direct)):
        assert_tree_equal(got["model"], want["model"], f"rank {rank} model")
        assert_tree_equal(got["shard_metadata"], want["shard_metadata"], f"rank {rank} metadata")
        assert got["cfg"] == want["cfg"]  # distributed_world_size m, distributed_rank its own


@pytest.mark.parametrize("n, m", WORLD_SIZES)
def test_optimizer_moments_stay_aligned_with_params(n: int, m: int) -> None:
    outs = reshard_shards(make_shards(make_model(seed=2), n), num_output_shards=m)
    for out in outs:
        state = out["last_optimizer_state"]["state"]
        for k, key in enumerate(_flat_keys()):
            param = out["model"][key]
            assert state[k]["exp_avg"].shape == param.shape
            assert torch.equal(state[k]["exp_avg"], param * 2)
            assert torch.equal(state[k]["exp_avg_sq"], param**2)


def test_tiny_flat_param_with_more_output_shards_pads_trailing_shards_fully() -> None:
    outs = reshard_shards(make_shards(make_model(), 2), num_output_shards=8)
    key = "decoder.layers.1.flat_param_0"  # 3 elements
    paddings = [o["shard_metadata"]["param_metadata"][2]["params"]["flat_param_0"]["padding"] for o in outs]
    assert [o["model"][key].numel() for o in outs] == [1] * 8
    assert paddings == [0, 0, 0, 1, 1, 1, 1, 1]
    assert all(torch.equal(o["model"][key], torch.zeros(1)) for o in outs[3:])


@pytest.mark.parametrize("n", [1, 3])
def test_step_int_and_tensor_are_carried(n: int) -> None:
    for step in ("int", "tensor"):
        outs = reshard_shards(make_shards(make_model(), n, step=step), num_output_shards=2)
        for out in outs:
            got = out["last_optimizer_state"]["state"][0]["step"]
            if step == "int":
                assert type(got) is int and got == STEP
            else:
                assert torch.is_tensor(got) and got.dim() == 0 and got.item() == STEP
            assert out["last_optimizer_state"]["loss_scale"] == LOSS_SCALE


def test_buffers_are_copied_from_rank_zero() -> None:
    shards = make_shards(make_model(), 3)
    for out in reshard_shards(shards, num_output_shards=2):
        assert torch.equal(out["model"]["decoder.version"], torch.tensor([3.0]))
        assert out["model"]["decoder.layers.0.position_ids"].dtype == torch.int64


# --- unflatten ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_unflatten_restores_original_params_and_buffers(n: int) -> None:
    model = make_model(seed=3)
    out = consolidate(make_shards(model, n))
    assert_tree_equal(out["model"], model.state_dict())
    assert "last_optimizer_state" not in out  # skipped by default


def test_unflatten_restores_tied_weights() -> None:
    model = make_model()
    out = consolidate(make_shards(model, 3))["model"]
    # root tie and a tie inside the nested "decoder.layers.0" instance, prefixed with its path
    assert torch.equal(out["decoder.output_projection.weight"], model.params["decoder.embed_tokens.weight"])
    assert torch.equal(out["decoder.layers.0.fc_tied.weight"], model.params["decoder.layers.0.fc1.weight"])
    assert "fc_tied.weight" not in out


def test_unflatten_keeps_metadata_with_zero_padding() -> None:
    out = consolidate(make_shards(make_model(), 3))
    for inst in out["shard_metadata"]["param_metadata"]:
        assert inst["params"]["flat_param_0"]["padding"] == 0


@pytest.mark.parametrize("n, m", WORLD_SIZES)
def test_reflattening_unflattened_output_equals_direct_reshard(n: int, m: int) -> None:
    shards = make_shards(make_model(seed=4), n)
    unflat = consolidate(shards, skip_optimizer_state=False)
    via_unflat = reshard_shards([unflat], num_output_shards=m)
    direct = reshard_shards(shards, num_output_shards=m)
    for got, want in zip(via_unflat, direct):
        assert_tree_equal(got["model"], want["model"])
        assert_tree_equal(got["shard_metadata"], want["shard_metadata"])
        assert_tree_equal(got["last_optimizer_state"]["state"], want["last_optimizer_state"]["state"])


def test_unflatten_then_reflatten_round_trips_model() -> None:
    shards = make_shards(make_model(seed=5), 4)
    back = reshard_shards([consolidate(shards)], num_output_shards=4)
    for got, want in zip(back, shards):
        assert_tree_equal(got["model"], want["model"])
        assert_tree_equal(got["shard_metadata"], want["shard_metadata"])


def test_consolidating_a_consolidated_file_changes_nothing() -> None:
    once = consolidate(make_shards(make_model(), 3, step="tensor"), skip_optimizer_state=False)
    twice = consolidate([once], skip_optimizer_state=False)
    assert_tree_equal(twice, once)


def test_consolidated_optimizer_state_has_fairscale_layout() -> None:
    model = make_model(seed=6)
    osd = consolidate(make_shards(model, 3, step="tensor"), skip_optimizer_state=False)["last_optimizer_state"]
    names = [join(path, name) for path, specs, _ in INSTANCES for name, _ in specs]
    assert list(osd["state"]) == list(range(len(names)))
    for g, name in enumerate(names):
        assert torch.equal(osd["state"][g]["exp_avg"], model.params[name] * 2)
        assert type(osd["state"][g]["step"]) is float and osd["state"][g]["step"] == STEP  # .item()
    assert osd["param_groups"][0]["params"] == list(range(len(names)))
    assert osd["param_id_map"] == {g: k for k, (_, specs, _) in enumerate(INSTANCES) for g in _ids(specs, k)}
    assert osd["uncollected_local_ids"] == []
    assert osd["loss_scale"] == LOSS_SCALE


def _ids(specs: tuple, k: int) -> range:
    start = sum(len(s) for _, s, _ in INSTANCES[:k])
    return range(start, start + len(specs))


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_consolidated_optimizer_state_loads_through_fairscale(world_size: int) -> None:
    """What FSDP.get_shard_from_optim_state_dict does: flatten_optim_state_dict, then _get_shard."""
    model = make_model(seed=7)
    osd = consolidate(make_shards(model, 3), skip_optimizer_state=False)["last_optimizer_state"]
    for rank, want in enumerate(make_shards(model, world_size)):
        flat = flatten_optim_state_dict(copy.deepcopy(osd))
        fake_fsdp = types.SimpleNamespace(world_size=world_size, rank=rank)
        for k, state in flat["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                got, _ = FullyShardedDataParallel._get_shard(fake_fsdp, state[name])
                assert torch.equal(got, want["last_optimizer_state"]["state"][k][name])
            assert state["step"] == STEP
        assert flat["param_groups"][0]["params"] == [0, 1, 2]


# --- options ------------------------------------------------------------------------------------


def test_output_dtype_casts_only_floating_model_tensors() -> None:
    shards = make_shards(make_model(), 2, step="tensor")
    for out in reshard_shards(shards, num_output_shards=3, output_dtype="bf16"):
        assert all(out["model"][key].dtype == torch.bfloat16 for key in _flat_keys())
        assert out["model"]["decoder.version"].dtype == torch.bfloat16
        assert out["model"]["decoder.layers.0.position_ids"].dtype == torch.int64
        state = out["last_optimizer_state"]["state"][0]
        assert state["exp_avg"].dtype == torch.float32
        assert state["step"].dtype == torch.float32
        assert out["last_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.98)


def test_output_dtype_applies_to_unflattened_weights() -> None:
    out = reshard_shards(make_shards(make_model(), 2), unflatten_weights=True, output_dtype="fp16")[0]["model"]
    assert out["decoder.layers.0.fc1.weight"].dtype == torch.float16
    assert out["decoder.layers.0.position_ids"].dtype == torch.int64


def test_drop_metaseq_req_keeps_train_iterator_key_as_none() -> None:
    shards = make_shards(make_model(), 2)
    out = reshard_shards(shards, drop_metaseq_req=True)[0]
    assert "train_iterator" in out["extra_state"] and out["extra_state"]["train_iterator"] is None
    assert out["extra_state"]["previous_training_time"] == 1.5
    assert shards[0]["extra_state"]["train_iterator"] is not None  # input untouched


def test_skip_optimizer_state_drops_it_and_keeps_other_keys() -> None:
    out = reshard_shards(make_shards(make_model(), 2), num_output_shards=3, skip_optimizer_state=True)[0]
    assert "last_optimizer_state" not in out
    assert out["optimizer_history"][-1]["num_updates"] == 42


# --- tolerated input variants -----------------------------------------------------------------


def test_wrapper_segments_in_model_keys_are_tolerated() -> None:
    shards = make_shards(make_model(), 2)
    wrapped = []
    for shard in shards:
        shard = dict(shard)
        shard["model"] = {_wrap(k): v for k, v in shard["model"].items()}
        wrapped.append(shard)
    for got, want in zip(reshard_shards(wrapped, num_output_shards=3), reshard_shards(shards, num_output_shards=3)):
        assert_tree_equal(got["model"], want["model"])


def _wrap(key: str) -> str:
    if key.startswith("decoder.layers.") and key.endswith("flat_param_0"):
        layer = key.rsplit(".", 1)[0]
        return f"_fsdp_wrapped_module._fpw_module.{layer}._fsdp_wrapped_module.flat_param_0"
    return f"_fsdp_wrapped_module._fpw_module.{key}" if "." in key else f"_fsdp_wrapped_module.{key}"


def test_metadata_without_optional_keys_is_accepted() -> None:
    model = make_model()
    shards = make_shards(model, 3, legacy_metadata=True)
    outs = reshard_shards(shards, num_output_shards=2)
    assert_tree_equal(outs[0]["model"], make_shards(model, 2)[0]["model"])
    unflat = consolidate(shards)["model"]
    assert "decoder.output_projection.weight" not in unflat  # no tie information in old files


def test_inputs_are_not_modified() -> None:
    shards = make_shards(make_model(), 3)
    before = copy.deepcopy(shards)
    reshard_shards(shards, num_output_shards=2, output_dtype="fp16", drop_metaseq_req=True)
    consolidate(shards, skip_optimizer_state=False)
    for got, want in zip(shards, before):
        assert_tree_equal(got, want)


def test_outputs_own_compact_storages() -> None:
    shards = make_shards(make_model(), 3)
    for out in reshard_shards(shards, num_output_shards=2) + [consolidate(shards, skip_optimizer_state=False)]:
        tensors = list(out["model"].values()) + [
            v for s in out["last_optimizer_state"]["state"].values() for v in s.values() if torch.is_tensor(v)
        ]
        for t in tensors:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_each_output_shard_reads_only_the_inputs_it_needs() -> None:
    shards = make_shards(make_model(), 4)
    inputs = [InputFile(f"s{r}", -1, 0, from_torch(s)[0]) for r, s in enumerate(shards)]
    plan = plan_structures(inputs, ReshardOptions(num_output_shards=8), [f"o{r}" for r in range(8)])
    read = {run.input for tensor in plan.outputs[7].tensors for run in tensor.runs}
    assert read == {0, 3}  # its flat pieces live in rank 3; buffers come from rank 0


# --- rejected inputs ----------------------------------------------------------------------------


def test_no_broadcast_optim_state_is_rejected() -> None:
    shards = make_shards(make_model(), 2)
    for shard in shards:
        shard["shard_metadata"]["param_metadata"][1]["no_broadcast_optim_state"] = True
    with pytest.raises(ReshardError, match="no_broadcast_optim_state.*not supported"):
        reshard_shards(shards)


def test_file_without_shard_metadata_is_called_consolidated() -> None:
    model = make_model()
    with pytest.raises(ReshardError, match="shard 0: no 'shard_metadata'.*consolidated"):
        reshard_shards([{"model": model.state_dict()}])


def test_metadata_disagreeing_across_shards_names_the_shard() -> None:
    shards = make_shards(make_model(), 3)
    shards[2]["shard_metadata"]["param_metadata"][1]["params"]["flat_param_0"]["shapes"][0] = torch.Size([3, 5])
    with pytest.raises(ReshardError, match="shard 2: shard_metadata disagrees with shard 0 on the shapes"):
        reshard_shards(shards)


def test_truncated_flat_tensor_reports_consumed_elements() -> None:
    shards = make_shards(make_model(), 2)  # root: 27 elements, 14 per rank, rank 1 padded by 1
    shards[1]["shard_metadata"]["param_metadata"][0]["params"]["flat_param_0"]["padding"] = 3
    with pytest.raises(ReshardError, match="consumed 25 of 27 elements"):
        reshard_shards(shards)


def test_flat_tensor_length_differing_across_shards_is_rejected() -> None:
    shards = make_shards(make_model(), 2)
    shards[1]["model"]["flat_param_0"] = shards[1]["model"]["flat_param_0"][:-1]
    with pytest.raises(ReshardError, match="shard 1: flat parameter 'flat_param_0' has 13 elements but shard 0 has 14"):
        reshard_shards(shards)


def test_optimizer_state_not_matching_flat_params_is_rejected() -> None:
    shards = make_shards(make_model(), 2)
    shards[1]["last_optimizer_state"]["state"][2]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ReshardError, match=r"shard 1: .*state\[2\]\['exp_avg'\] has shape \[5\]"):
        reshard_shards(shards)
    shards = make_shards(make_model(), 2)
    for shard in shards:
        shard["last_optimizer_state"]["state"][7] = {"step": 1}
    with pytest.raises(ReshardError, match="state has id 7 but shard_metadata lists 3 flat parameters"):
        reshard_shards(shards)


def test_broken_optimizer_state_is_fine_when_skipped() -> None:
    shards = make_shards(make_model(), 2)
    shards[1]["last_optimizer_state"]["state"][2]["exp_avg"] = torch.zeros(5)
    assert "last_optimizer_state" not in reshard_shards(shards, skip_optimizer_state=True)[0]


def test_unflatten_with_several_param_groups_needs_skipped_optimizer_state() -> None:
    shards = make_shards(make_model(), 2)
    for shard in shards:
        groups = shard["last_optimizer_state"]["param_groups"]
        groups.append({**groups[0], "params": [2]})
        groups[0]["params"] = [0, 1]
    with pytest.raises(ReshardError, match="2 param groups.*pass --skip-optimizer-state"):
        consolidate(shards, skip_optimizer_state=False)
    assert "decoder.layers.1.scale" in consolidate(shards)["model"]
    outs = reshard_shards(shards, num_output_shards=3)  # flat outputs carry the groups as they are
    assert [g["params"] for g in outs[0]["last_optimizer_state"]["param_groups"]] == [[0, 1], [2]]


def test_unflattened_file_among_shards_is_rejected() -> None:
    shards = make_shards(make_model(), 2)
    with pytest.raises(ReshardError, match="looks unflattened"):
        reshard_shards([consolidate(shards), shards[1]])


@pytest.mark.parametrize("options, message", [
    ({"num_output_shards": "2"}, "--num-output-shards='2': must be an integer"),
    ({"num_output_shards": True}, "--num-output-shards=True: must be an integer"),
    ({"skip_optimizer_state": "False"}, "--skip-optimizer-state='False': must be True or False"),
    ({"num_output_parts": 1.5}, "--num-output-parts=1.5: must be an integer or None"),
    ({"input_glob_pattern": None}, "--input-glob-pattern=None: must be a string"),
])
def test_options_of_the_wrong_type_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ReshardError, match=re.escape(message)):
        ReshardOptions(**options)
    assert ReshardOptions(input_glob_pattern=Path("~/x.pt")).input_glob_pattern == os.path.expanduser("~/x.pt")


@pytest.mark.parametrize("options, message", [
    ({"num_output_parts": 2}, "num_output_parts applies to files only"),
    ({"verify": True}, "verify applies to files only"),
])
def test_in_memory_reshard_refuses_what_it_cannot_do(options: dict, message: str) -> None:
    shards = make_shards(make_model(), 2)
    with pytest.raises(ReshardError, match=message):
        reshard_shards(shards, **options)
    with pytest.raises(ReshardError, match="a list of checkpoint dicts"):
        reshard_shards(shards[0])
