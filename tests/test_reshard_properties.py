"""Property-based tests: random FSDP structures and world sizes, resharded in memory.

Structures: 1-4 FSDP instances of 1-4 parameters each, shapes with 0-dim (1 element),
1-element and empty tensors, ties inside any instance, float/int buffers or none,
fp32 or bf16 weights. Shards are cut by fairscale's own `_get_shard` (tests/synthetic.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaseq.file_io import load_checkpoint
from metaseq.reshard import reshard_fsdp_checkpoints, reshard_shards
from synthetic import Instances, SyntheticModel, assert_tree_equal, join, make_model, make_shards, write_shards

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORLD = st.integers(min_value=1, max_value=16)
CARRIED = ("model", "shard_metadata", "optimizer_history")  # plus optimizer state, compared apart

SHAPES = st.one_of(
    st.just(()),  # a 0-dim parameter: one element
    st.just((1,)),
    st.just((0, 3)),  # empty
    st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=3).map(tuple),
)


@st.composite
def instances(draw: st.DrawFn) -> Instances:
    out = []
    for idx in range(draw(st.integers(min_value=1, max_value=4))):
        path = "" if idx == 0 else f"decoder.layers.{idx - 1}"
        shapes = draw(st.lists(SHAPES, min_size=1, max_size=4))
        if all(torch.Size(s).numel() == 0 for s in shapes):
            shapes[0] = (2,)  # FSDP never builds an empty flat parameter
        names = [f"p{j}.weight" for j in range(len(shapes))]
        tied = draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
        ties = tuple((src, f"tied_{src}") for src in tied)
        out.append((path, tuple(zip(names, shapes)), ties))
    return tuple(out)


@st.composite
def models(draw: st.DrawFn) -> SyntheticModel:
    buffers = {}
    if draw(st.booleans()):
        buffers["decoder.version"] = torch.tensor([3.0])
    if draw(st.booleans()):
        buffers["decoder.layers.0.position_ids"] = torch.arange(draw(st.integers(min_value=0, max_value=5)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return make_model(draw(st.integers(0, 2**16)), dtype, instances=draw(instances()), buffers=buffers)


def _flat_keys(model: SyntheticModel) -> list[str]:
    return [join(path, "flat_param_0") for path, _, _ in model.instances]


def _assert_same_shards(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        for key in CARRIED:
            assert_tree_equal(g[key], w[key], f"rank {rank} {key}")
        assert_tree_equal(g["last_optimizer_state"], w["last_optimizer_state"], f"rank {rank} optimizer")


@SETTINGS
@given(model=models(), n=WORLD, m=WORLD, step=st.sampled_from(["int", "tensor"]))
def test_n_to_m_equals_fairscale_sharding_and_back_to_n_is_exact(model, n: int, m: int, step: str) -> None:
    shards = make_shards(model, n, step=step)
    to_m = reshard_shards(shards, num_output_shards=m)
    _assert_same_shards(to_m, make_shards(model, m, step=step))
    _assert_same_shards(reshard_shards(to_m, num_output_shards=n), shards)


@SETTINGS
@given(model=models(), n=WORLD, m=WORLD)
def test_n_to_one_unflattened_to_m_equals_n_to_m(model, n: int, m: int) -> None:
    shards = make_shards(model, n)
    unflat = reshard_shards(shards, unflatten_weights=True)[0]
    assert_tree_equal(unflat["model"], model.state_dict(), "unflattened model")  # ties and buffers included
    _assert_same_shards(reshard_shards([unflat], num_output_shards=m), reshard_shards(shards, num_output_shards=m))


@SETTINGS
@given(model=models(), n=WORLD, m=WORLD)
def test_optimizer_moments_stay_aligned_with_their_parameters(model, n: int, m: int) -> None:
    # make_shards sets exp_avg = 2 * param and exp_avg_sq = param ** 2 (in fp32), padding included
    for out in reshard_shards(make_shards(model, n), num_output_shards=m):
        state = out["last_optimizer_state"]["state"]
        for k, key in enumerate(_flat_keys(model)):
            param = out["model"][key].float()
            assert torch.equal(state[k]["exp_avg"], param * 2), f"{key}: exp_avg misaligned"
            assert torch.equal(state[k]["exp_avg_sq"], param**2), f"{key}: exp_avg_sq misaligned"
    unflat = reshard_shards(make_shards(model, n), unflatten_weights=True)[0]
    names = [join(path, name) for path, specs, _ in model.instances for name, _ in specs]
    state = unflat["last_optimizer_state"]["state"]
    for g, name in enumerate(names):
        param = model.params[name].float()
        assert state[g]["exp_avg"].shape == param.shape
        assert torch.equal(state[g]["exp_avg"], param * 2), f"{name}: consolidated exp_avg misaligned"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models(), n=WORLD, m=WORLD, step=st.sampled_from(["int", "tensor"]), unflatten=st.booleans())
def test_files_written_equal_the_in_memory_reshard(model, n: int, m: int, step: str, unflatten: bool) -> None:
    """Files the writer copies bytes into load as exactly what the in-memory reshard builds."""
    m = 1 if unflatten else m
    shards = make_shards(model, n, step=step)
    want = reshard_shards(shards, num_output_shards=m, unflatten_weights=unflatten)
    with tempfile.TemporaryDirectory() as tmp:
        write_shards(shards, Path(tmp) / "in")
        args = (str(Path(tmp) / "in" / "*.pt"), str(Path(tmp) / "out" / "s{i}.pt"))
        paths = reshard_fsdp_checkpoints(*args, num_output_shards=m, unflatten_weights=unflatten)
        got = [load_checkpoint(p) for p in paths]
        if unflatten:  # and the consolidated file back to n flat shards
            back = reshard_fsdp_checkpoints(paths[0], str(Path(tmp) / "back" / "s{i}.pt"), num_output_shards=n)
            assert_tree_equal([load_checkpoint(p) for p in back], reshard_shards(want, num_output_shards=n), "back")
    for rank, (g, w) in enumerate(zip(got, want)):
        assert_tree_equal(g, w, f"output {rank}")


def test_zero_dim_parameter_keeps_its_moments_through_consolidation() -> None:
    # a 0-dim parameter's exp_avg is a 0-dim tensor in the consolidated layout, like `step`;
    # it must still be resharded per element, not carried as a scalar
    model = make_model(instances=(("", (("scale", ()), ("bias", (2,))), ()), ("decoder.layers.0", (("gain", ()),), ())))
    shards = make_shards(model, 3, step="tensor")
    unflat = reshard_shards(shards, unflatten_weights=True)[0]
    assert unflat["last_optimizer_state"]["state"][2]["exp_avg"].shape == torch.Size([])
    back = reshard_shards([unflat], num_output_shards=3)
    for got, want in zip(back, shards):
        got_state, want_state = got["last_optimizer_state"]["state"], want["last_optimizer_state"]["state"]
        for k in (0, 1):
            for name in ("exp_avg", "exp_avg_sq"):
                assert_tree_equal(got_state[k][name], want_state[k][name], f"state[{k}][{name}]")
