"""The reshard tool on checkpoints of real fairscale FSDP wrapped otherwise than our trainer wraps its model."""
import pytest
import torch

from fsdp_harness import load_other_way, run_on_ranks, train_other_way
from metaseq.file_io import load_checkpoint
from metaseq.scripts.reshard_fsdp import main as reshard_main

SHARD = "ckpt-model_part-0-shard{i}.pt"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (folder of its 2 shards, the full state dict FSDP gives)."""
    out = {}
    for kind in ("noflat", "tied", "mixed"):
        folder = tmp_path_factory.mktemp(kind)
        run_on_ranks(train_other_way, 2, kind, str(folder / SHARD), str(folder / "full.pt"))
        out[kind] = folder, torch.load(folder / "full.pt", weights_only=True)
    return out


def _reshard(capsys, folder, output, *flags):
    code = reshard_main(["--input", str(folder / "ckpt-model_part-0-shard*.pt"), "--output", str(output), "--quiet",
                         *flags])
    return code, capsys.readouterr().err.strip()


def _assert_equal(found, expected):
    assert sorted(found) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(found[key], value), key


def test_parameters_sharded_one_by_one_reshard_both_ways(saved, tmp_path, capsys):
    """flatten_parameters=False: 2 -> 3 shards load into FSDP at 3 ranks (optimizer state too), and back to 2 give
    the input tensors again; consolidated, the names and values of FSDP's full state dict."""
    folder, full = saved["noflat"]
    assert _reshard(capsys, folder, tmp_path / "three" / SHARD, "--num-output-shards", "3") == (0, "")
    run_on_ranks(load_other_way, 3, "noflat", str(tmp_path / "three" / SHARD), str(tmp_path / "full3.pt"))
    _assert_equal(torch.load(tmp_path / "full3.pt", weights_only=True), full)
    assert _reshard(capsys, tmp_path / "three", tmp_path / "two" / SHARD, "--num-output-shards", "2") == (0, "")
    for i in range(2):
        before, after = (load_checkpoint(d / SHARD.format(i=i)) for d in (folder, tmp_path / "two"))
        _assert_equal(after["model"], before["model"])
        for k, state in before["last_optimizer_state"]["state"].items():
            assert torch.equal(after["last_optimizer_state"]["state"][k]["exp_avg"], state["exp_avg"])
    assert _reshard(capsys, folder, tmp_path / "one.pt", "--unflatten-weights") == (0, "")
    _assert_equal(load_checkpoint(tmp_path / "one.pt")["model"], full)


def test_a_tie_in_parameters_sharded_one_by_one_stays_a_tie(saved, tmp_path, capsys):
    """flatten_parameters=False with a tied weight: FSDP's local_state_dict holds the shard under both names, which
    shard_metadata lists once. Resharded 2 -> 3 it loads at 3 ranks with the tie; consolidated, the tied weight is
    the whole weight, one storage with its source, and back to 2 shards gives the input tensors again."""
    folder, full = saved["tied"]
    assert torch.equal(full["twin.weight"], full["pre.weight"]) and full["twin.weight"].shape == (7, 5)
    assert _reshard(capsys, folder, tmp_path / "three" / SHARD, "--num-output-shards", "3") == (0, "")
    assert _one_storage(load_checkpoint(tmp_path / "three" / SHARD.format(i=1))["model"], "twin.weight", "pre.weight")
    run_on_ranks(load_other_way, 3, "tied", str(tmp_path / "three" / SHARD), str(tmp_path / "full3.pt"))
    _assert_equal(torch.load(tmp_path / "full3.pt", weights_only=True), full)
    one = tmp_path / "one" / SHARD.format(i=0)
    assert _reshard(capsys, folder, one, "--unflatten-weights", "--verify") == (0, "")
    _assert_equal(load_checkpoint(one)["model"], full)
    assert _one_storage(load_checkpoint(one)["model"], "twin.weight", "pre.weight")
    assert _reshard(capsys, one.parent, tmp_path / "two" / SHARD, "--num-output-shards", "2", "--verify") == (0, "")
    for i in range(2):
        _assert_equal(*(load_checkpoint(d / SHARD.format(i=i))["model"] for d in (tmp_path / "two", folder)))


def test_a_tie_in_an_ema_mirror_stays_a_tie_and_one_split_from_it_is_refused(saved, tmp_path, capsys):
    """An EMA (extra_state['ema'], laid out like model) of such a model: its tied weight held as model holds it is
    resharded as a tie; held as a tensor of its own (each entry cloned), it is refused, not copied from rank 0."""
    folder, _ = saved["tied"]
    for kind, ema in (("alias", dict), ("split", lambda model: {k: v.clone() for k, v in model.items()})):
        for i in range(2):
            ckpt = load_checkpoint(folder / SHARD.format(i=i))
            ckpt["extra_state"] = {"ema": ema(ckpt["model"])}
            (tmp_path / kind).mkdir(exist_ok=True)
            torch.save(ckpt, tmp_path / kind / SHARD.format(i=i))
    assert _reshard(capsys, tmp_path / "alias", tmp_path / "three" / SHARD, "--num-output-shards", "3") == (0, "")
    three = load_checkpoint(tmp_path / "three" / SHARD.format(i=2))
    assert _one_storage(three["extra_state"]["ema"], "twin.weight", "pre.weight")
    assert torch.equal(three["extra_state"]["ema"]["pre.weight"], three["model"]["pre.weight"])
    code, err = _reshard(capsys, tmp_path / "split", tmp_path / "out" / SHARD, "--num-output-shards", "3")
    assert code == 2 and err == (f"ERROR: {tmp_path / 'split' / SHARD.format(i=0)}: extra_state['ema']['twin.weight'] "
                                 "is a tensor of its own, but model holds it as 'pre.weight' (tied in an instance with "
                                 "flatten_parameters=False); extra_state['ema'] must hold it as model does, one tensor "
                                 "under both names, to be resharded") and not (tmp_path / "out").exists()


def _one_storage(model, *keys) -> bool:
    return len({model[key].untyped_storage().data_ptr() for key in keys}) == 1


def test_one_flat_shard_of_parameters_fsdp_keeps_whole_is_refused(saved, tmp_path, capsys):
    """At world size 1 FSDP does not shard flatten_parameters=False parameters: a 1-D file would not load."""
    code, err = _reshard(capsys, saved["noflat"][0], tmp_path / "one.pt")
    assert code == 2 and "--num-output-shards=1" in err and "'pre.weight'" in err and "--unflatten-weights" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "one.pt").exists()


def test_optimizer_state_of_a_root_kept_unflat_around_a_nested_instance_is_refused(saved, tmp_path, capsys):
    """The root's parameters lie around the nested instance in the optimizer's order but before it in
    shard_metadata: the state ids cannot be matched. Without optimizer state the weights reshard."""
    folder, full = saved["mixed"]
    code, err = _reshard(capsys, folder, tmp_path / "three" / SHARD, "--num-output-shards", "3")
    assert code == 2 and "'blk.flat_param_0'" in err and "--skip-optimizer-state" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "three").exists()
    flags = ("--num-output-shards", "3", "--skip-optimizer-state")
    assert _reshard(capsys, folder, tmp_path / "three" / SHARD, *flags) == (0, "")
    run_on_ranks(load_other_way, 3, "mixed", str(tmp_path / "three" / SHARD), str(tmp_path / "full3.pt"))
    _assert_equal(torch.load(tmp_path / "full3.pt", weights_only=True), full)


def test_optimizer_state_of_parameters_given_out_of_order_is_refused(tmp_path, capsys):
    """State id 1 is `a`'s (12 elements) where shard_metadata puts `b` (11): 6 per rank both, so only the nonzero
    moment in what is `b`'s padding tells; read as `b`'s, `a`'s last moment would be dropped."""
    run_on_ranks(train_other_way, 2, "reversed", str(tmp_path / SHARD), str(tmp_path / "full.pt"))
    code, err = _reshard(capsys, tmp_path, tmp_path / "three" / SHARD, "--num-output-shards", "3")
    assert code == 2 and "state[1]['exp_avg']" in err and "'b.flat_param_0'" in err and "order" in err
    assert "--skip-optimizer-state" in err and len(err.splitlines()) == 1 and not (tmp_path / "three").exists()
    flags = ("--num-output-shards", "3", "--skip-optimizer-state")
    assert _reshard(capsys, tmp_path, tmp_path / "three" / SHARD, *flags) == (0, "")
    run_on_ranks(load_other_way, 3, "reversed", str(tmp_path / "three" / SHARD), str(tmp_path / "full3.pt"))
    _assert_equal(torch.load(tmp_path / "full3.pt", weights_only=True), torch.load(tmp_path / "full.pt"))


def test_optimizer_state_nan_in_the_padding_is_read(tmp_path, capsys):
    """Adam with eps=0 makes the padding's parameter 0 / 0 and, with weight decay, its moments NaN: not another
    parameter's state (which the padding check looks for), so the shards reshard."""
    run_on_ranks(train_other_way, 3, "eps0", str(tmp_path / SHARD), str(tmp_path / "full.pt"))
    assert load_checkpoint(tmp_path / SHARD.format(i=2))["last_optimizer_state"]["state"][0]["exp_avg"][-1].isnan()
    assert _reshard(capsys, tmp_path, tmp_path / "two" / SHARD, "--num-output-shards", "2") == (0, "")
    run_on_ranks(load_other_way, 2, "eps0", str(tmp_path / "two" / SHARD), str(tmp_path / "full2.pt"))
    _assert_equal(torch.load(tmp_path / "full2.pt", weights_only=True), torch.load(tmp_path / "full.pt"))


def test_ranks_holding_only_padding_are_not_taken_for_copies(tmp_path, capsys):
    """Their cfg says no rank and their files are alike (a rank past the model's elements holds zeros): they are
    read, also as the tool writes them back (4 -> 2 -> 4 -> 2), and load into FSDP."""
    run_on_ranks(train_other_way, 4, "tiny", str(tmp_path / SHARD), str(tmp_path / "full.pt"))
    for n, (src, dst) in zip((2, 4, 2), ((tmp_path, "two"), ("two", "four"), ("four", "back"))):
        assert _reshard(capsys, tmp_path / src, tmp_path / dst / SHARD, "--num-output-shards", str(n)) == (0, "")
    run_on_ranks(load_other_way, 2, "tiny", str(tmp_path / "back" / SHARD), str(tmp_path / "full2.pt"))
    _assert_equal(torch.load(tmp_path / "full2.pt", weights_only=True), torch.load(tmp_path / "full.pt"))


def test_optimizer_state_of_a_world_size_1_run_kept_unflat_is_refused(tmp_path, capsys):
    """At world size 1 its weights are whole (unflattened) beside the rank's own optimizer state."""
    run_on_ranks(train_other_way, 1, "noflat", str(tmp_path / SHARD), str(tmp_path / "full.pt"))
    code, err = _reshard(capsys, tmp_path, tmp_path / "out" / SHARD, "--num-output-shards", "2")
    assert code == 2 and "param_id_map" in err and "--skip-optimizer-state" in err and len(err.splitlines()) == 1
    flags = ("--num-output-shards", "2", "--skip-optimizer-state")
    assert _reshard(capsys, tmp_path, tmp_path / "out" / SHARD, *flags) == (0, "")
    run_on_ranks(load_other_way, 2, "noflat", str(tmp_path / "out" / SHARD), str(tmp_path / "full2.pt"))
    _assert_equal(torch.load(tmp_path / "full2.pt", weights_only=True), torch.load(tmp_path / "full.pt"))
