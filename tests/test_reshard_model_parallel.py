"""`python -m metaseq.scripts.reshard_model_parallel`: P parts x N shards -> Q parts x M shards, on real fairscale runs.

The runs come from `conftest.mp_runs` (real FSDP over fairscale's tensor-parallel layers,
CPU/gloo); what the outputs hold is read back by real FSDP on real ranks (`mp_harness`).
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from metaseq.checkpoint_utils import RestoreError, read_restore_files
from metaseq.cli import interactive_cli
from metaseq.file_io import load_checkpoint
from metaseq.hub_utils import InferenceLoadError, build_inference_model, load_inference_checkpoint
from metaseq.models.partition import split_param
from metaseq.scripts.compare_checkpoints import main as compare
from metaseq.scripts.reshard_fsdp import main as reshard_fsdp
from metaseq.scripts.reshard_model_parallel import main
from mp_harness import FIXED_TOKENS, MOMENTS, compute_logits, gather_full_state, run_train_mp
from synthetic import SyntheticModel, make_model, make_shards, write_shards
from training import losses

REL_TOL = 1e-4  # summation order differs between one matrix product and P partial ones
SHARDS = "checkpoint_{n}-model_part-*-shard*.pt"
OUT = "checkpoint_last-model_part-{j}-shard{i}.pt"


def _reshard(src: Path, out: str, *flags: str, n: str = "last") -> None:
    assert main(["--input", str(src / SHARDS.format(n=n)), "--output", out, "--quiet", *flags]) == 0


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_same_state(got: dict, want: dict) -> None:
    """Every parameter and Adam moment, merged over the parts, bit for bit."""
    for kind in ("model", *MOMENTS):
        assert got[kind].keys() == want[kind].keys(), kind
        for name, tensor in want[kind].items():
            assert torch.equal(got[kind][name], tensor), f"{kind} of {name}"


# --- P = 2 -> Q = 1 ------------------------------------------------------------------------------


def test_two_parts_to_one_file_give_the_same_logits_and_answers(mp_runs, tmp_path, capsys, monkeypatch):
    save_dir, _ = mp_runs["p2"]
    _reshard(save_dir, str(tmp_path / "one" / "reshard-model_part-{j}.pt"), "--num-output-parts", "1",
             "--unflatten-weights", "True", "--skip-optimizer-state", "True")
    ckpt = load_checkpoint(tmp_path / "one" / "reshard-model_part-0.pt")  # weights_only: nothing unsafe
    assert ckpt["cfg"]["common"]["model_parallel_size"] == 1
    assert ckpt["cfg"]["distributed_training"]["distributed_world_size"] == 1
    model = build_inference_model(ckpt, source="one")  # the plain P = 1 model, strict load
    with torch.no_grad():
        plain = model(FIXED_TOKENS)
    parallel = compute_logits(save_dir / "checkpoint_last.pt", FIXED_TOKENS, model_parallel_size=2,
                              out_path=tmp_path / "logits.pt")
    assert torch.allclose(plain, parallel, atol=1e-5, rtol=0), (plain - parallel).abs().max()
    # interactive_cli: the file, and the two consolidated parts merged on the fly, answer alike
    assert reshard_fsdp(["--input", str(save_dir / "checkpoint_last-model_part-{j}-shard*.pt"),
                         "--output", str(tmp_path / "parts" / "reshard-model_part-{j}.pt"),
                         "--unflatten-weights", "--skip-optimizer-state", "--quiet"]) == 0
    answers = []
    for path in (tmp_path / "one" / "reshard-model_part-0.pt", tmp_path / "parts" / "reshard-model_part-{j}.pt"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("what is the meaning of life?\nthe cat\n"))
        assert interactive_cli.main(["--path", str(path), "--max-new-tokens", "8"]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and len(answers[0].splitlines()) == 2


def test_two_parts_to_one_part_of_two_shards_resume_the_run(mp_runs, tmp_path):
    save_dir, uninterrupted = mp_runs["p2"]
    out = tmp_path / "q1m2"
    _reshard(save_dir, str(out / OUT), "--num-output-parts", "1", "--num-output-shards", "2", n="2")
    assert sorted(p.name for p in out.iterdir()) == [OUT.format(j=0, i=i) for i in (0, 1)]
    want = gather_full_state(save_dir / "checkpoint_2.pt", model_parallel_size=2, out_path=tmp_path / "want.pt")
    got = gather_full_state(out / "checkpoint_last.pt", model_parallel_size=1, out_path=tmp_path / "got.pt")
    _assert_same_state(got, want)  # what real P = 1 FSDP loads: load_local_state_dict + optimizer state
    resumed = losses(run_train_mp(out, model_parallel_size=1, world_size=2, max_update=4,
                                  extra=["--restore-file", str(out / "checkpoint_last.pt")]))
    assert sorted(resumed) == [3, 4]
    for update, loss in resumed.items():
        assert _relative(loss, uninterrupted[update]) < REL_TOL, (update, loss, uninterrupted[update])


def test_one_part_to_two_parts_resumes_the_run(mp_runs, tmp_path):
    save_dir, uninterrupted = mp_runs["p1"]
    out = tmp_path / "q2"
    _reshard(save_dir, str(out / OUT), "--num-output-parts", "2", n="2")
    want = gather_full_state(save_dir / "checkpoint_2.pt", model_parallel_size=1, out_path=tmp_path / "want.pt")
    got = gather_full_state(out / "checkpoint_last.pt", model_parallel_size=2, out_path=tmp_path / "got.pt")
    _assert_same_state(got, want)
    resumed = losses(run_train_mp(out, model_parallel_size=2, world_size=2, max_update=4,
                                  extra=["--restore-file", str(out / "checkpoint_last.pt")]))
    for update, loss in resumed.items():
        assert _relative(loss, uninterrupted[update]) < REL_TOL, (update, loss, uninterrupted[update])


def test_two_parts_to_four_parts_resumes_the_run(tmp_path):
    """4 parts need a model with 4 heads; it is trained here at P = 2 (D = 1) and resumed at P = 4."""
    sizes = ["--decoder-embed-dim", "32", "--decoder-attention-heads", "4"]
    run = losses(run_train_mp(tmp_path / "p2", model_parallel_size=2, world_size=2, max_update=4,
                              extra=[*sizes, "--save-interval-updates", "2"]))
    out = tmp_path / "q4"
    _reshard(tmp_path / "p2", str(out / OUT), "--num-output-parts", "4", n="2")
    assert len(list(out.iterdir())) == 4
    want = gather_full_state(tmp_path / "p2" / "checkpoint_2.pt", model_parallel_size=2, out_path=tmp_path / "w.pt")
    got = gather_full_state(out / "checkpoint_last.pt", model_parallel_size=4, out_path=tmp_path / "g.pt")
    _assert_same_state(got, want)
    resumed = losses(run_train_mp(out, model_parallel_size=4, world_size=4, max_update=4,
                                  extra=[*sizes, "--restore-file", str(out / "checkpoint_last.pt")]))
    for update, loss in resumed.items():
        assert _relative(loss, run[update]) < REL_TOL, (update, loss, run[update])


@pytest.mark.parametrize("run", ["p2", "p2_fused"])
def test_one_part_and_back_is_bit_identical(mp_runs, tmp_path, run):
    """P = 2, D = 2 -> Q = 1, M = 1 (the metadata real FSDP writes at P = 1) -> Q = 2, M = 2: the same files."""
    save_dir, _ = mp_runs[run]
    files = sorted(save_dir.glob(SHARDS.format(n="last")))
    shards_per_part = len(files) // 2
    _reshard(save_dir, str(tmp_path / "one" / OUT), "--num-output-parts", "1")
    plain = load_checkpoint(mp_runs[run.replace("p2", "p1")][0] / OUT.format(j=0, i=0))  # a real P = 1 run
    assert load_checkpoint(tmp_path / "one" / OUT.format(j=0, i=0))["shard_metadata"] == plain["shard_metadata"]
    assert main(["--input", str(tmp_path / "one" / "*.pt"), "--output", str(tmp_path / "back" / OUT),
                 "--num-output-parts", "2", "--num-output-shards", str(shards_per_part), "--quiet"]) == 0
    for path in files:
        want, got = load_checkpoint(path), load_checkpoint(tmp_path / "back" / path.name)
        for key, tensor in want["model"].items():
            assert torch.equal(got["model"][key], tensor), (path.name, key)
        for k, state in want["last_optimizer_state"]["state"].items():
            for name in MOMENTS:
                assert torch.equal(got["last_optimizer_state"]["state"][k][name], state[name]), (path.name, k, name)
        assert got["shard_metadata"] == want["shard_metadata"]


# --- refusals and warnings, on synthetic parts -------------------------------------------------------

FULL = (  # one model, cut by the partition rules into parts below
    ("", (("decoder.embed_tokens.weight", (12, 4)), ("decoder.embed_positions.weight", (5, 4)),
          ("decoder.layer_norm.weight", (4,))),
     (("decoder.embed_tokens.weight", "decoder.output_projection.weight"),)),
    ("decoder.layers.0", (("self_attn.qkv_proj.weight", (12, 4)), ("self_attn.out_proj.weight", (4, 4)),
                          ("fc1.weight", (8, 4)), ("fc2.weight", (4, 8)), ("fc2.bias", (4,))), ()),
)


def _write_parts(folder: Path, parts: int, shards: int, *, heads: int = 2, full=FULL) -> SyntheticModel:
    """The full model's parts, each as `shards` FSDP shards (fairscale's split), cfg as training writes it."""
    model = make_model(instances=full)
    for j in range(parts):
        params = {name: split_param(name, t, parts)[j].contiguous() for name, t in model.params.items()}
        local = tuple((path, tuple((n, tuple(params[f"{path}.{n}" if path else n].shape)) for n, _ in specs), ties)
                      for path, specs, ties in full)
        part = make_shards(SyntheticModel(params, model.buffers, local), shards)
        for i, shard in enumerate(part):
            shard["cfg"]["common"] = {"model_parallel_size": parts}
            shard["cfg"]["model"] = {"decoder_attention_heads": heads}
            shard["cfg"]["distributed_training"].update(distributed_world_size=parts * shards,
                                                        distributed_rank=i * parts + j)
        write_shards(part, folder, part=j)
    return model


def _fails(capsys, folder: Path, *flags: str, pattern: str = "*.pt") -> str:
    assert main(["--input", str(folder / pattern), "--output", str(folder / "out" / OUT), "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("ERROR: "), err
    assert not (folder / "out").exists()
    return err


def test_part_files_swapped_are_refused_by_every_reader(tmp_path, capsys):
    """Files renamed out of the order of the ranks that saved them: each part's shards are in order, but part 0's
    hold part 1's slices. Reshard and training restore refuse them."""
    _write_parts(tmp_path, 2, 2)
    for i in range(2):
        names = [tmp_path / f"checkpoint_last-model_part-{j}-shard{i}.pt" for j in range(2)]
        names[0].rename(tmp_path / "tmp")
        names[1].rename(names[0])
        (tmp_path / "tmp").rename(names[1])
    words = ("checkpoint_last-model_part-0-shard0.pt was saved by rank 1 (its cfg's distributed_rank) but its name "
             "says rank 0: the files were renamed or swapped")
    assert words in _fails(capsys, tmp_path, "--num-output-parts", "1")
    braces = ["--input", str(tmp_path / "checkpoint_last-model_part-{j}-shard*.pt"), "--output", str(tmp_path / "out"
              / OUT), "--quiet"]
    assert reshard_fsdp(braces) == 2 and words in capsys.readouterr().err
    with pytest.raises(RestoreError, match=words.replace("(", r"\(").replace(")", r"\)")):
        read_restore_files(str(tmp_path / "checkpoint_last.pt"), 4, 2)


def test_a_part_consolidated_beside_a_part_of_raw_shards_is_refused_naming_both(tmp_path, capsys):
    _write_parts(tmp_path, 2, 2)
    assert reshard_fsdp(["--input", str(tmp_path / "checkpoint_last-model_part-1-shard*.pt"), "--output",
                         str(tmp_path / "checkpoint_last-model_part-1.pt"), "--unflatten-weights", "--quiet"]) == 0
    for i in range(2):
        (tmp_path / OUT.format(j=1, i=i)).unlink()
    err = _fails(capsys, tmp_path, "--num-output-parts", "1")
    assert err.startswith(f"ERROR: {tmp_path}/checkpoint_last-model_part-1.pt: model_part-1 is one consolidated file "
                          f"but model_part-0 is raw shards ({tmp_path}/checkpoint_last-model_part-0-shard0.pt, "), err
    assert "give every part in one form" in err


@pytest.mark.parametrize("q, words", [
    ("3", "does not divide the 2 attention heads in cfg['model']['decoder_attention_heads']; --num-output-parts 1, 2"),
])
def test_parts_that_do_not_divide_the_heads_are_refused(tmp_path, capsys, q, words):
    _write_parts(tmp_path, 1, 2)
    assert words in _fails(capsys, tmp_path, "--num-output-parts", q)


@pytest.mark.parametrize("name, shape, words", [
    ("decoder.embed_tokens.weight", (10, 4), "does not divide the 10 vocabulary rows of decoder.embed_tokens.weight"),
    ("decoder.layers.0.fc1.weight", (5, 4), "does not divide the 5 rows of decoder.layers.0.fc1.weight"),
    ("decoder.layers.0.fc2.weight", (4, 5), "does not divide the 5 columns of decoder.layers.0.fc2.weight"),
    ("decoder.layers.0.self_attn.qkv_proj.weight", (6, 4),
     "does not divide the 2 rows of decoder.layers.0.self_attn.qkv_proj.weight in each of its 3 blocks"),
])
def test_parts_that_do_not_divide_a_tensor_are_refused(tmp_path, capsys, name, shape, words):
    full = tuple((path, tuple((n, shape if (f"{path}.{n}" if path else n) == name else s) for n, s in specs), ties)
                 for path, specs, ties in FULL)
    _write_parts(tmp_path, 1, 1, full=full, heads=4)
    err = _fails(capsys, tmp_path, "--num-output-parts", "4")
    assert words in err and "would" in err


def test_the_part_counts_suggested_fit_the_heads_and_every_cut_tensor(tmp_path, capsys):
    """4 heads would take 4 parts, but 10 vocabulary rows would not: 1 and 2 are what fits both."""
    full = tuple((path, tuple((n, (10, 4) if n == "decoder.embed_tokens.weight" else s) for n, s in specs), ties)
                 for path, specs, ties in FULL)
    _write_parts(tmp_path, 1, 1, full=full, heads=4)
    err = _fails(capsys, tmp_path, "--num-output-parts", "3")
    heads = "cfg['model']['decoder_attention_heads']"
    assert f"does not divide the 4 attention heads in {heads}; --num-output-parts 1, 2 would" in err


@pytest.mark.parametrize("q", ["1", "2"])
def test_verify_passes_cuts_of_consolidated_parts_whose_ties_are_stored(tmp_path, capsys, q):
    """A consolidated part stores the tied copy under its own name, as a slice of that part: --verify checks the
    output part's tie against the planned cut, not against input part 0's stored slice."""
    _write_parts(tmp_path / "raw", 2, 1)
    pattern = str(tmp_path / "raw" / OUT.replace("{j}", "{{j}}").format(i="*"))
    assert reshard_fsdp(["--input", pattern, "--output", str(tmp_path / "cons" / "reshard-model_part-{j}.pt"),
                         "--unflatten-weights", "--quiet"]) == 0
    assert main(["--input", str(tmp_path / "cons" / "*.pt"), "--output", str(tmp_path / "q" / "r-model_part-{j}.pt"),
                 "--num-output-parts", q, "--unflatten-weights", "--verify", "--quiet"]) == 0, capsys.readouterr().err
    assert len(list((tmp_path / "q").glob("*.pt"))) == int(q)


def test_missing_shard_file_is_named(tmp_path, capsys):
    _write_parts(tmp_path, 2, 2)
    (tmp_path / OUT.format(j=1, i=0)).unlink()
    assert f"{tmp_path / OUT.format(j=1, i=0)} is missing" in _fails(capsys, tmp_path, "--num-output-parts", "1")


def test_a_folder_or_a_saves_name_is_answered_with_every_parts_glob(tmp_path, capsys):
    """This tool takes all parts at once: the globs suggested match them all (a per-part tool's would be refused)."""
    _write_parts(tmp_path, 2, 2)
    every = repr(str(tmp_path / SHARDS.format(n="last")))
    assert f"it is a folder: name a checkpoint in it, e.g. {every}" in _fails(capsys, tmp_path, "--num-output-parts",
                                                                             "1", pattern="")
    err = _fails(capsys, tmp_path, "--num-output-parts", "1", pattern="checkpoint_last.pt")
    assert f"it names a save, not its files: pass the shard files, e.g. {every}" in err


def test_missing_part_is_named(tmp_path, capsys):
    _write_parts(tmp_path, 2, 2)
    err = _fails(capsys, tmp_path, "--num-output-parts", "1", pattern="*model_part-0-*.pt")
    assert "model_part-1 is missing" in err and "model_parallel_size" in err


def test_stray_file_and_gap_between_parts_are_named(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    (tmp_path / OUT.format(j=1, i=0)).rename(tmp_path / OUT.format(j=2, i=0))
    torch.save({"model": {}}, tmp_path / "stray.pt")
    err = _fails(capsys, tmp_path, "--num-output-parts", "1")
    assert f"{tmp_path / 'stray.pt'}: no model part ('model_part-J') in its name; narrow --input-glob-pattern" in err
    (tmp_path / "stray.pt").unlink()
    assert "model_part-1 is missing: --input-glob-pattern" in _fails(capsys, tmp_path, "--num-output-parts", "1")


def test_parts_with_other_shard_counts_are_refused(tmp_path, capsys):
    _write_parts(tmp_path, 2, 2)
    part1 = make_shards(make_model(), 3)
    write_shards(part1[2:], tmp_path / "extra")
    (tmp_path / "extra" / OUT.format(j=0, i=0)).rename(tmp_path / OUT.format(j=0, i=2))
    assert "model_part-1 has 2 shard files, other parts 3" in _fails(capsys, tmp_path, "--num-output-parts", "1")


def test_parts_of_different_models_are_refused(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    write_shards(make_shards(make_model(), 1), tmp_path, part=1)  # another model's parameters
    err = _fails(capsys, tmp_path, "--num-output-parts", "1")
    assert f"{tmp_path / OUT.format(j=1, i=0)}: model part 1 has other parameters than part 0" in err


def test_parts_of_different_saves_are_refused_with_and_without_a_new_part_count(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    later = tmp_path / OUT.format(j=1, i=0)
    ckpt = torch.load(later, weights_only=False)
    ckpt["optimizer_history"][-1]["num_updates"] += 1  # part 1 from the next save
    torch.save(ckpt, later)
    words = f"{later} was saved at update 43 but {tmp_path / OUT.format(j=0, i=0)} at update 42"
    assert words in _fails(capsys, tmp_path, "--num-output-parts", "1")
    pattern = str(tmp_path / OUT.replace("{j}", "{{j}}").format(i="*"))  # reshard_fsdp: each part on its own
    assert reshard_fsdp(["--input", pattern, "--output", str(tmp_path / "out" / OUT), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_shapes_that_contradict_the_rules_are_refused(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    shards = make_shards(make_model(instances=FULL), 1)  # part 1 rewritten with whole, uncut tensors
    write_shards(shards, tmp_path, part=1)
    assert ("decoder.embed_tokens.weight: its shape differs between model parts ([[6, 4], [12, 4]]); "
            "every part holds an equal slice, so the parts come from different models") in _fails(
        capsys, tmp_path, "--num-output-parts", "1")


def test_legacy_parts_torch_loads_only_if_trusted_take_trust_checkpoint(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    for path in tmp_path.glob("*.pt"):  # torch's safe loader reads no pickle of protocol 4
        torch.save(torch.load(path, weights_only=False), path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    assert "if you trust this file, pass --trust-checkpoint" in _fails(capsys, tmp_path, "--num-output-parts", "1")
    assert main(["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / OUT), "--quiet",
                 "--num-output-parts", "1", "--trust-checkpoint"]) == 0


def test_a_weight_without_the_dim_its_rule_cuts_is_refused(tmp_path, capsys):
    """fc2.weight is cut along dim 1 (row-parallel): a 1-D one is another model's."""
    (root, (path, specs, ties)) = FULL
    full = (root, (path, tuple((n, (32,) if n == "fc2.weight" else shape) for n, shape in specs), ties))
    write_shards(make_shards(make_model(instances=full), 1), tmp_path)
    assert _fails(capsys, tmp_path, "--num-output-parts", "2") == (
        "ERROR: decoder.layers.0.fc2.weight: shape [32] has no dim 1 to cut, as its rule says; the partition rules "
        "(metaseq.models.partition) are for metaseq's OPT-style model, which this is not\n")


@pytest.mark.parametrize("flags, words", [
    (["--num-output-parts", "2", "--num-output-shards", "2", "--unflatten-weights"], "--unflatten-weights needs"),
    (["--num-output-parts", "2", "--output", "OUT/x-shard{i}.pt"], "--num-output-parts=2 but --output-shard-name"),
    (["--num-output-parts", "2", "--output", "OUT/model_part-{j}/x{i}.pt"],  # read back by the file's name
     "has no 'model_part-{j}' in its file name"),
    (["--num-output-parts", "1", "--num-output-shards", "2", "--output", "OUT/part{j}.pt"],
     "--num-output-shards=2 but --output-shard-name"),
    (["--num-output-parts", "2", "--num-output-shards", "2", "--output", "OUT/reshard-model_part-{j}.pt"],  # as given
     "--output-shard-name 'OUT/reshard-model_part-{j}.pt' has no '{i}'; add it where the shard index goes, e.g. "
     "'OUT/reshard-model_part-{j}-shard{i}.pt'"),
])
def test_option_and_name_errors(tmp_path, capsys, flags, words):
    _write_parts(tmp_path, 2, 1)
    flags = [f.replace("OUT", str(tmp_path / "out")) for f in flags]
    assert main(["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / OUT), *flags]) == 2
    assert words.replace("OUT", str(tmp_path / "out")) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fewer_parts_over_an_earlier_runs_parts_are_refused(tmp_path, capsys):
    _write_parts(tmp_path, 2, 1)
    argv = ["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / "reshard-model_part-{j}.pt"),
            "--unflatten-weights", "--overwrite", "--quiet"]
    assert main([*argv, "--num-output-parts", "2"]) == 0
    assert main([*argv, "--num-output-parts", "1"]) == 2
    assert f"{tmp_path}/out/reshard-model_part-1.pt, named like the outputs, would stay" in capsys.readouterr().err


def test_replicated_state_that_differs_between_parts_warns_uses_part_0_and_compares_different(tmp_path, capsys):
    """A replicated tensor, its Adam moment and step should be equal in every part: merged, part 0's are kept
    (with a warning naming each); compared, the parts are not the merged file (it lost part 1's copies), but
    are the same as themselves."""
    _write_parts(tmp_path, 2, 1)
    path = tmp_path / OUT.format(j=1, i=0)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"]["flat_param_0"][-1] += 0.5  # the root's flat parameter ends with decoder.layer_norm.weight[3]
    state = ckpt["last_optimizer_state"]["state"][0]
    state["exp_avg"][-2] += 0.25  # its moment, of decoder.layer_norm.weight[2]
    state["step"] += 1
    torch.save(ckpt, path)
    assert main(["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / "p{j}.pt"),
                 "--num-output-parts", "1", "--unflatten-weights"]) == 0
    err = capsys.readouterr().err
    assert "WARNING: decoder.layer_norm.weight differs between parts (max diff 0.5, part 1 vs part 0); using part 0" in err
    assert "WARNING: exp_avg of decoder.layer_norm.weight differs between parts (max diff 0.25, part 1 vs part 0)" in (
        err)
    step = "WARNING: last_optimizer_state.state[0]['step'] differs between parts (part 1 vs part 0); using part 0's"
    assert step in err
    got = load_checkpoint(tmp_path / "out" / "p0.pt")["model"]["decoder.layer_norm.weight"]
    part0 = load_checkpoint(tmp_path / OUT.format(j=0, i=0))["model"]["flat_param_0"]
    assert torch.equal(got, part0[-4:])
    assert compare([str(tmp_path / "*.pt"), str(tmp_path / "out" / "p0.pt")]) == 1
    out = capsys.readouterr().out
    for key in ("decoder.layer_norm.weight", "optimizer exp_avg of decoder.layer_norm.weight",
                "optimizer step of decoder.layer_norm.weight"):
        assert f"differs: {key} (model part 1's copy, unlike part 0's): only in A" in out, out
    assert compare([str(tmp_path / "*.pt"), str(tmp_path / "*.pt")]) == 0
    assert capsys.readouterr().out.strip().endswith("SAME: the checkpoints hold the same model and optimizer state")


def test_each_part_kept_as_it_is_keeps_its_own_buffers(tmp_path, capsys):
    """Resharded to as many parts, part 1 is input part 1: its own buffer copy, not part 0's; compared, a part whose
    buffer differs from part 0's is named."""
    _write_parts(tmp_path, 2, 1)
    path = tmp_path / OUT.format(j=1, i=0)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"]["decoder.version"] += 3
    torch.save(ckpt, path)
    assert main(["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / OUT), "--num-output-parts", "2",
                 "--num-output-shards", "2", "--quiet"]) == 0
    for j in range(2):
        got = load_checkpoint(tmp_path / "out" / OUT.format(j=j, i=1))["model"]["decoder.version"]
        assert torch.equal(got, load_checkpoint(tmp_path / OUT.format(j=j, i=0))["model"]["decoder.version"]), j
    assert compare([str(tmp_path / "*.pt"), str(tmp_path / "out" / "*.pt")]) == 0
    capsys.readouterr()
    merged = tmp_path / "merged" / "p0.pt"
    assert main(["--input", str(tmp_path / "*.pt"), "--output", str(merged), "--num-output-parts", "1",
                 "--unflatten-weights", "--quiet"]) == 0
    assert compare([str(tmp_path / "*.pt"), str(merged)]) == 1
    assert "differs: decoder.version (model part 1's copy, unlike part 0's): only in A" in capsys.readouterr().out


def test_inference_merges_consolidated_parts(mp_runs, tmp_path):
    """interactive_cli's loader takes the P consolidated parts (a glob or '{j}') and merges them."""
    save_dir, _ = mp_runs["p2_fused"]
    assert reshard_fsdp(["--input", str(save_dir / "checkpoint_last-model_part-{j}-shard*.pt"),
                         "--output", str(tmp_path / "reshard-model_part-{j}.pt"), "--unflatten-weights",
                         "--skip-optimizer-state", "--quiet"]) == 0
    merged = load_inference_checkpoint(str(tmp_path / "reshard-model_part-*.pt"))
    from_shards = load_inference_checkpoint(str(save_dir / "checkpoint_last.pt"))  # a stem: every part's shards
    _reshard(save_dir, str(tmp_path / "one" / "reshard-model_part-{j}.pt"), "--num-output-parts", "1",
             "--unflatten-weights", "True", "--skip-optimizer-state", "True")
    one = load_checkpoint(tmp_path / "one" / "reshard-model_part-0.pt")
    assert merged["model"].keys() == one["model"].keys()
    for name, tensor in one["model"].items():
        assert torch.equal(merged["model"][name], tensor), name
        assert torch.equal(from_shards["model"][name], tensor), name
    (tmp_path / "reshard-model_part-1.pt").unlink()
    with pytest.raises(InferenceLoadError) as error:  # named as interactive_cli's flag, not the reshard tool's
        load_inference_checkpoint(str(tmp_path / "reshard-model_part-{j}.pt"))
    message = str(error.value)
    assert "cannot consolidate its files: " in message and "but the glob of its parts matches 1" in message
    assert "--input-glob-pattern" not in message


@pytest.mark.parametrize("p, n, q, m", [(2, 3, 1, 1), (4, 3, 1, 2), (1, 3, 4, 1), (4, 2, 2, 3), (2, 2, 4, 3)])
def test_every_cut_gives_the_split_of_the_full_model(tmp_path, p, n, q, m):
    """P x N -> Q x M (flat, optimizer state too) -> Q x 1 unflattened: each part is `split_param`'s slice
    of the full model, whichever rows cross an input shard's boundary; the moments follow (exp_avg = 2 * param)."""
    model = _write_parts(tmp_path / "in", p, n, heads=4)
    assert main(["--input", str(tmp_path / "in" / "*.pt"), "--output", str(tmp_path / "mid" / OUT), "--quiet",
                 "--num-output-parts", str(q), "--num-output-shards", str(m)]) == 0
    assert main(["--input", str(tmp_path / "mid" / "*.pt"), "--output", str(tmp_path / "out" / "reshard-model_part-{j}.pt"),
                 "--quiet", "--num-output-parts", str(q), "--unflatten-weights"]) == 0
    for j in range(q):
        got = load_checkpoint(tmp_path / "out" / f"reshard-model_part-{j}.pt")
        state = got["last_optimizer_state"]["state"]  # fairscale's consolidated layout: one entry per parameter
        for i, (name, full) in enumerate(model.params.items()):
            assert torch.equal(got["model"][name], split_param(name, full, q)[j]), (j, name)
            assert torch.equal(state[i]["exp_avg"], 2 * got["model"][name]), (j, name)


def test_dry_run_and_verify_of_a_model_parallel_plan(tmp_path, capsys):
    _write_parts(tmp_path, 2, 2)
    argv = ["--input", str(tmp_path / "*.pt"), "--output", str(tmp_path / "out" / OUT), "--num-output-parts", "1",
            "--num-output-shards", "3"]
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 file(s) of all model parts -> 1 part(s) x 3 flat shard(s)" in out and "output part 0 shard 2" in out
    assert not (tmp_path / "out").exists()
    braces = ["--input", str(tmp_path / "checkpoint_last-model_part-{j}-shard*.pt"), *argv[2:]]  # as reshard_fsdp's
    assert main([*braces, "--dry-run"]) == 0 and capsys.readouterr().out == out
    assert main([*argv, "--verify"]) == 0
    assert "verified 3 output(s): 9 parameters, 2 buffers, 16 optimizer tensors bit-identical" in capsys.readouterr().err


def test_compare_checkpoints_merges_model_parts(mp_runs, tmp_path, capsys):
    """Two parts against the one part they were merged into: SAME, optimizer state included; against the run at P = 1
    (same seed and batches) the cut parameters differ only by summation order."""
    save_dir, p1 = mp_runs["p2"][0], mp_runs["p1"][0]
    _reshard(save_dir, str(tmp_path / "one" / OUT), "--num-output-parts", "1")
    assert compare([str(save_dir / SHARDS.format(n="last")), str(tmp_path / "one" / "*.pt")]) == 0
    out = capsys.readouterr().out
    assert "A: 2 model parts of 2 flat shard(s)" in out and "B: 1 flat shard" in out
    assert out.strip().endswith("SAME: the checkpoints hold the same model and optimizer state"), out
    assert compare([str(save_dir / "checkpoint_last-model_part-{j}-shard*.pt"), str(p1 / SHARDS.format(n="last")),
                    "--skip-optimizer-state"]) == 1
    assert "differs: decoder.layers.0.fc1.weight: max abs diff" in capsys.readouterr().out
    assert compare([str(save_dir / SHARDS.format(n="last")), str(p1 / SHARDS.format(n="last")), "--atol", "1e-4",
                    "--skip-optimizer-state", "--quiet"]) == 0


def test_compare_checkpoints_of_one_model_part_says_so(mp_runs, tmp_path, capsys):
    """One part's shards hold a slice of each cut weight: the report names the part, and SAME is about that part."""
    save_dir = mp_runs["p2"][0]
    part0 = str(save_dir / "checkpoint_last-model_part-0-shard*.pt")
    argv = ["--input", part0, "--output", str(tmp_path / "p0" / "s{i}.pt"), "--num-output-shards", "3"]
    assert reshard_fsdp([*argv, "--quiet"]) == 0
    assert compare([part0, str(tmp_path / "p0" / "s*.pt")]) == 0
    out = capsys.readouterr().out
    assert "A: model part 0 of 2: 2 flat shards" in out and "B: model part 0 of 2: 3 flat shards" in out, out
    assert "note: A and B each hold one model part: the other parts are not compared; give every part's" in out
    assert out.strip().endswith("SAME: the checkpoints hold the same model part and optimizer state"), out
    part1 = str(save_dir / "checkpoint_last-model_part-1-shard*.pt")  # named without its part: its cfg's rank says
    assert reshard_fsdp(["--input", part1, "--output", str(tmp_path / "p1" / "s{i}.pt"), "--quiet"]) == 0
    assert compare([part1, str(tmp_path / "p1" / "s0.pt"), "--quiet"]) == 0
    assert compare([part0, str(tmp_path / "p1" / "s0.pt")]) == 1
    assert "B: model part 1 of 2: 1 flat shard" in capsys.readouterr().out
