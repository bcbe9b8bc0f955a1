"""The Hugging Face bridge end to end: convert_from_hf / convert_to_hf, logits, training, real OPT files."""
import argparse
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, pipeline

from metaseq.checkpoint_utils import read_restore_files
from metaseq.cli import interactive_cli, train
from metaseq.file_io import atomic_torch_save, load_checkpoint
from metaseq.hf import BPETokenizer, ByteTokenizer, model_config_from_cfg
from metaseq.hf.fsdp_layout import fsdp_shard_metadata
from metaseq.hub_utils import GenerationConfig, GeneratorInterface, build_inference_model
from metaseq.models.partition import split_param
from metaseq.models.transformer_lm import ModelConfig, build_model
from metaseq.scripts import convert_from_hf, convert_to_hf, reshard_fsdp
from test_hf_tokenizer import write_gpt2_files
from real_metaseq import RealRunSpec, write_real_runs
from training import REPO, run_train

QUESTION = "what is the meaning of life?"
SHARDS = "checkpoint_last-model_part-0-shard{i}.pt"
ODD = dict(vocab_size=61, hidden_size=18, num_hidden_layers=2, ffn_dim=37, num_attention_heads=3,
           max_position_embeddings=23)


def make_hf_model(folder, *, dtype=torch.float32, seed=0, **sizes):
    """A random OPTForCausalLM saved with save_pretrained; every tensor (LayerNorms, biases too) random."""
    sizes = {**ODD, **sizes}
    config = OPTConfig(word_embed_proj_dim=sizes["hidden_size"], dropout=0.0, **sizes)
    torch.manual_seed(seed)
    model = OPTForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model.to(dtype).save_pretrained(str(folder))
    return model


def hf_tensors(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def assert_close_logits(ours, theirs):
    """Within 1e-5 of the logits' scale; returns the max difference (measured figure)."""
    diff, scale = (ours - theirs).abs().max().item(), theirs.abs().max().item()
    assert diff <= 1e-5 * scale, (diff, scale)
    return f"{diff:.3g} (logits up to {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_to_ours_to_hf_is_bit_identical(tmp_path, dtype):
    make_hf_model(tmp_path / "hf", dtype=dtype)
    ours = tmp_path / "reshard-model_part-0.pt"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(ours),
                                 "--num-output-shards", "1", "--unflatten-weights", "True", "-q"]) == 0
    ckpt = load_checkpoint(ours)  # weights_only
    assert ckpt["model"]["decoder.embed_tokens.weight"].dtype == dtype
    assert ckpt["shard_metadata"] == fsdp_shard_metadata(ModelConfig.from_dict(ckpt["cfg"]["model"]))
    assert convert_to_hf.main(["--input", str(ours), "--output", str(tmp_path / "back"), "-q"]) == 0
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back"))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["dtype"] == str(dtype).replace("torch.", "") and config["tie_word_embeddings"] is True
    model, info = OPTForCausalLM.from_pretrained(str(tmp_path / "back"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_quoted_tilde_means_the_home_folder_both_ways(tmp_path, monkeypatch):
    make_hf_model(tmp_path / "hf")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "hf")
    assert convert_from_hf.main(["--input", "~/hf", "--output-shard-name", "~/w2/" + SHARDS,
                                 "--num-output-shards", "2", "-q"]) == 0
    assert convert_to_hf.main(["--input", "~/w2/" + SHARDS.replace("{i}", "*"), "--output", "~/back", "-q"]) == 0
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back"))
    assert not (tmp_path / "hf" / "~").exists()


def test_hf_to_three_raw_shards_resharded_to_one_back_to_hf_is_bit_identical(tmp_path):
    make_hf_model(tmp_path / "hf")
    shards = str(tmp_path / "w3" / SHARDS)
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", shards,
                                 "--num-output-shards", "3", "-q"]) == 0
    files = sorted(os.listdir(tmp_path / "w3"))
    assert files == [SHARDS.format(i=i) for i in range(3)]
    assert "flat_param_0" in load_checkpoint(tmp_path / "w3" / files[0])["model"]
    one = str(tmp_path / "reshard-model_part-0.pt")
    assert reshard_fsdp.main(["--input-glob-pattern", shards.replace("{i}", "*"), "--output-shard-name", one,
                              "--num-output-shards", "1", "--unflatten-weights", "True"]) == 0
    for source, out in ((one, "via_reshard"), (shards.replace("{i}", "*"), "from_glob")):
        assert convert_to_hf.main(["--input", source, "--output", str(tmp_path / out), "-q"]) == 0
        assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / out))


def test_random_odd_sized_hf_opt_gives_our_model_the_same_logits(tmp_path):
    hf_model = make_hf_model(tmp_path / "hf", seed=3)
    ours = tmp_path / "ours.pt"
    convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(ours),
                          "--unflatten-weights", "True", "-q"])
    model = build_inference_model(load_checkpoint(ours), source=str(ours))
    tokens = torch.randint(0, ODD["vocab_size"], (3, ODD["max_position_embeddings"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = assert_close_logits(model(tokens), hf_model(tokens).logits)
    print(f"max |logit diff| HF -> ours: {diff}")


def test_hf_to_two_shards_one_update_at_lr_0_back_to_hf_and_real_fsdp_metadata(tmp_path):
    """Real FSDP (metaseq.cli.train, 2 ranks) resumes the converted shards; at lr 0 the weights stay bit-identical."""
    make_hf_model(tmp_path / "hf", vocab_size=260, max_position_embeddings=50)
    converted = tmp_path / "converted"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(converted / SHARDS),
                                 "--num-output-shards", "2", "-q"]) == 0
    trained = tmp_path / "trained"
    proc = run_train(trained, world_size=2, max_update=1,
                     extra=["--lr", "0", "--restore-file", str(converted / "checkpoint_last.pt")])
    assert "no optimizer state" in proc.stderr  # Adam starts from scratch, and says so
    served = GeneratorInterface.from_checkpoint(str(converted / "checkpoint_last.pt"))  # raw shards serve too
    assert served.generate([QUESTION], GenerationConfig(max_new_tokens=3)) is not None
    for rank in range(2):
        ours = load_checkpoint(converted / SHARDS.format(i=rank))["shard_metadata"]
        fsdp = load_checkpoint(trained / SHARDS.format(i=rank))["shard_metadata"]
        assert ours == fsdp, rank  # names, shapes, order, padding, shared_param_info as fairscale writes them
    assert convert_to_hf.main(["--input", str(trained / SHARDS.replace("{i}", "*")), "--output", str(tmp_path / "back"), "-q"]) == 0
    assert_same_tensors(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back"))


def test_restoring_bf16_weights_for_training_warns_that_they_become_float32(tmp_path, caplog):
    make_hf_model(tmp_path / "hf", dtype=torch.bfloat16)
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(tmp_path / "w2" / SHARDS),
                                 "--num-output-shards", "2", "-q"]) == 0
    with caplog.at_level(logging.WARNING, logger="metaseq"):
        read_restore_files(str(tmp_path / "w2" / "checkpoint_last.pt"), 2)
    assert "the weights are torch.bfloat16; training runs in float32, so they are loaded and saved as float32" in (
        caplog.text)


def test_training_from_a_converted_model_checks_its_vocabulary_against_the_byte_tokenizer(tmp_path, caplog):
    """Training reads --data with the byte tokenizer (260 ids): a smaller vocabulary is refused before any rank
    starts (its embedding would be indexed past its end); a larger one (OPT's 50272) trains on those ids, with a
    warning."""
    args = ["--data", str(REPO / "metaseq" / "assets" / "qa_corpus.txt"), "--save-dir", str(tmp_path / "run"),
            "--world-size", "2", "--max-update", "3"]
    for vocab in (61, 300):
        make_hf_model(tmp_path / f"hf{vocab}", vocab_size=vocab)
        assert convert_from_hf.main(["--input", str(tmp_path / f"hf{vocab}"), "--output-shard-name",
                                     str(tmp_path / f"w{vocab}" / SHARDS), "--num-output-shards", "2", "-q"]) == 0
    restore = ["--restore-file", str(tmp_path / "w61" / "checkpoint_last.pt")]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="metaseq.cli.train"):
        assert train.main([*args, *restore]) == 2
    assert (f"--restore-file {restore[1]}: the model has 61 tokens, fewer than the 260 ids of the byte tokenizer "
            "that --data is read with") in caplog.text
    assert not (tmp_path / "run").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="metaseq.cli.train"):
        cfg = train.config_from_args(train.build_parser().parse_args(
            [*args, "--restore-file", str(tmp_path / "w300" / "checkpoint_last.pt")]))
    assert cfg.model.vocab_size == 300 and "the model has 300 tokens (another tokenizer's" in caplog.text


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A model trained by metaseq.cli.train until it answers QUESTION, exported from its raw shard by `python -m`."""
    save_dir = tmp_path_factory.mktemp("memorize_hf")
    run_train(save_dir, world_size=1, max_update=150, extra=["--batch-size", "16", "--seq-len", "64", "--lr", "1e-2"])
    out = save_dir / "hf"
    proc = subprocess.run([sys.executable, "-m", "metaseq.scripts.convert_to_hf", "--input",
                           str(save_dir / SHARDS.replace("{i}", "*")), "--output", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    return save_dir, out


def test_a_saves_name_exports_its_shards_and_shard_errors_name_the_input_flag(exported, tmp_path, capsys):
    save_dir, out = exported
    assert convert_to_hf.main(["--input", str(save_dir / "checkpoint_last.pt"), "--output", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    code, err = _run_cli(convert_to_hf, ["--input", str(save_dir / "checkpoint_*-shard*.pt"),
                                         "--output", str(tmp_path / "two")], capsys)
    assert code == 2 and "--input matches two checkpoints (or a copy): make it match one" in err, err
    assert "--input-glob-pattern" not in err and not (tmp_path / "two").exists()


def test_trained_model_exported_to_hf_gives_hf_our_logits(exported):
    save_dir, out = exported
    ours = GeneratorInterface.from_checkpoint(str(save_dir / "checkpoint_last.pt")).model
    model, info = OPTForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, *ByteTokenizer.newline_ids]
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok(["what is the meaning of life? what do cats chase? and why reshard?"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        diff = assert_close_logits(ours(ids), model(ids).logits)
    print(f"max |logit diff| trained ours -> HF: {diff}")


def test_hf_pipeline_answers_the_demo_question_as_our_cli(exported, monkeypatch, capsys):
    save_dir, out = exported
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\nwhat do cats chase?\n"))
    assert interactive_cli.main(["--path", str(save_dir / "checkpoint_last.pt")]) == 0
    cli_answers = capsys.readouterr().out.splitlines()
    generator = pipeline("text-generation", model=str(out))
    hf_answers = [generator(q, return_full_text=False)[0]["generated_text"].strip()
                  for q in (QUESTION, "what do cats chase?")]
    assert hf_answers == cli_answers == ["To be happy.", "Mice."]
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))  # the exported tokenizer serves alike
    assert interactive_cli.main(["--path", str(save_dir / "checkpoint_last.pt"), "--hf-tokenizer", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == ["To be happy."]


def _run_cli(module, argv, capsys):
    capsys.readouterr()  # drop what came before (e.g. save_pretrained's progress bar)
    code = module.main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _bad_config(field, value):
    def change(folder):
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config[field] = value
        path.write_text(json.dumps(config))
    return change


def _mix_dtypes(folder):
    """fp16 weights with fp32 LayerNorms: FSDP's flat parameters could not keep both dtypes."""
    state = {k: v if "layer_norm" in k else v.half() for k, v in hf_tensors(folder).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _int8_weights(folder):
    state = {k: (v * 100).to(torch.int8) for k, v in hf_tensors(folder).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _float64_weights(folder):  # would convert, but not back
    save_file({k: v.double() for k, v in hf_tensors(folder).items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def _untie_head(folder):
    state = hf_tensors(folder)
    state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"] + 1
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _weight_twice(folder):  # under both names: loaders differ in which they take
    state = hf_tensors(folder)
    state["decoder.layers.0.fc1.weight"] = state["model.decoder.layers.0.fc1.weight"] + 1
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("change, message", [
    (lambda f: (f / "config.json").unlink(), "no config.json there"),
    (_weight_twice, "'decoder.layers.0.fc1.weight' is there twice, with and without the 'model.' prefix"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json: holds a JSON list, not an object"),
    (_mix_dtypes, "the weights mix dtypes: 26 float16 .*, 10 float32 .*layer_norm"),
    (lambda f: (f / "model.safetensors").unlink(), "no weights there"),
    (_int8_weights, "the weights are int8, not floating point .*; save the model in float32, float16 or bfloat16"),
    (_float64_weights, "the weights are float64, which the export back to HF does not take; save the model in"),
    (_bad_config("tie_word_embeddings", False), "tie_word_embeddings=False .*not tied"),
    (_untie_head, "'lm_head.weight' differs from the token embedding"),
    (_bad_config("activation_function", "gelu"), "activation_function='gelu'"),
    (_bad_config("do_layer_norm_before", False), "do_layer_norm_before=False .*post-LayerNorm"),
    (_bad_config("word_embed_proj_dim", 9), "word_embed_proj_dim=9 differs from hidden_size=18 .*project_in"),
    (_bad_config("enable_bias", False), "enable_bias=False"),
    (_bad_config("num_attention_heads", 4), "config.json: hidden_size=18 is not divisible by num_attention_heads=4"),
])
def test_unsupported_hf_folders_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, change, message):
    make_hf_model(tmp_path / "hf")
    change(tmp_path / "hf")
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "hf"), "--output-shard-name",
                                           str(tmp_path / "out" / SHARDS), "--num-output-shards", "2"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()


def test_output_name_and_existing_outputs_are_checked_first(tmp_path, capsys):
    make_hf_model(tmp_path / "hf")
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "hf"), "--output-shard-name",
                                           str(tmp_path / "x.pt"), "--num-output-shards", "2"], capsys)
    assert code == 2 and "has no '{i}'" in err
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "hf"), "--output-shard-name",
                                           str(tmp_path / "p{j}-shard{i}.pt"), "--num-output-shards", "2"], capsys)
    assert code == 2 and "'{j}' (the model part) does not apply: the output is one model part, part 0; write 0" in err
    weights = (tmp_path / "hf" / "model.safetensors").read_bytes()
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "hf"), "--output-shard-name",
                                           str(tmp_path / "hf" / "model.safetensors"), "--overwrite"], capsys)
    assert code == 2 and "model.safetensors is also an input; write to another name" in err, err
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == weights
    (tmp_path / "back").mkdir()
    (tmp_path / "back" / "keep.txt").write_text("mine")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "x.pt"), "--output", str(tmp_path / "back")], capsys)
    assert code == 2 and "exists and is not empty; pass --overwrite" in err
    assert os.listdir(tmp_path / "back") == ["keep.txt"]
    atomic_torch_save({"model": {}}, tmp_path / "back" / "x.pt")  # an input in the output folder: that comes first
    for extra in ([], ["--overwrite"]):
        code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "back" / "x.pt"), "--output",
                                             str(tmp_path / "back"), *extra], capsys)
        assert code == 2 and f"holds the input {tmp_path / 'back' / 'x.pt'}, which replacing" in err, err


@pytest.mark.parametrize("tool", ["convert_from_hf", "convert_to_hf"])
@pytest.mark.parametrize("signum, code, words", [(signal.SIGTERM, 2, "terminated by SIGTERM"),
                                                 (signal.SIGINT, 130, "interrupted")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_conversion_is_one_line_and_leaves_no_outputs_or_temp_files(tmp_path, monkeypatch, capsys, tool,
                                                                                signum, code, words):
    """convert_from_hf: after the temp consolidated file and the first output shard are in place; convert_to_hf:
    after its temp consolidated file. Both temp folders (in TMPDIR) and the outputs go."""
    make_hf_model(tmp_path / "hf")
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(tmp_path / "w2" / SHARDS),
                                 "--num-output-shards", "2", "-q"]) == 0
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    renamed = []

    def then_signal(rename):
        def renamed_then_signal(src, dst):
            rename(src, dst)
            renamed.append(dst)
            if len(renamed) == (2 if tool == "convert_from_hf" else 1):
                os.kill(os.getpid(), signum)
        return renamed_then_signal

    for name in ("replace", "link"):  # renames into place: os.link where no file may be replaced
        monkeypatch.setattr(os, name, then_signal(getattr(os, name)))
    if tool == "convert_from_hf":
        argv = ["--input", str(tmp_path / "hf"), "--output-shard-name", str(tmp_path / "out" / SHARDS),
                "--num-output-shards", "2"]
    else:
        argv = ["--input", str(tmp_path / "w2" / SHARDS.replace("{i}", "*")), "--output", str(tmp_path / "out")]
    assert getattr(sys.modules[f"metaseq.scripts.{tool}"], "main")(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"ERROR: {words}; any outputs of this run were removed"
    assert os.listdir(tmp_path / "tmp") == [] and not (tmp_path / "out").exists()


def test_checkpoints_of_the_earlier_variant_are_refused_for_export(tmp_path, capsys):
    make_hf_model(tmp_path / "hf", vocab_size=260)
    ours = tmp_path / "ours.pt"
    convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(ours), "--unflatten-weights", "-q"])
    ckpt = load_checkpoint(ours)
    for field in ("no_scale_embedding", "position_offset"):  # as files written before the OPT-exact change
        del ckpt["cfg"]["model"][field]
    ckpt["model"]["decoder.embed_positions.weight"] = ckpt["model"]["decoder.embed_positions.weight"][2:].clone()
    atomic_torch_save(ckpt, tmp_path / "old.pt")
    old = GeneratorInterface.from_checkpoint(str(tmp_path / "old.pt"))  # still served
    assert old.model.cfg.no_scale_embedding is False and old.model.cfg.position_offset == 0
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "old.pt"), "--output", str(tmp_path / "back")], capsys)
    assert code == 2 and "before the OPT-exact change" in err and len(err.splitlines()) == 1
    assert "its embeddings are scaled and its positions are offset by 0, not 2, which OPTForCausalLM" in err
    assert not (tmp_path / "back").exists()
    ckpt["cfg"]["model"]["position_offset"] = 0  # only the offset left as it was: named alone
    ckpt["cfg"]["model"]["no_scale_embedding"] = True
    atomic_torch_save(ckpt, tmp_path / "offset.pt")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "offset.pt"), "--output", str(tmp_path / "b")],
                         capsys)
    assert code == 2 and "position_offset=0): its positions are offset by 0, not 2, which" in err, err


def test_sharded_safetensors_pytorch_bin_and_sharded_bin_without_prefix_convert_alike(tmp_path):
    """Also a pytorch_model.bin in torch's legacy (non-zip) format, which transformers loads too."""
    make_hf_model(tmp_path / "hf")
    state = hf_tensors(tmp_path / "hf")
    names = sorted(state)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    halves = {"model-00001-of-00002": names[::2], "model-00002-of-00002": names[1::2]}
    folders = {kind: tmp_path / kind for kind in ("sharded", "bin", "sharded_bin", "legacy_bin")}
    for kind, folder in folders.items():
        folder.mkdir()
        # null: transformers reads it as hidden_size (as some hub configs have it)
        (folder / "config.json").write_text(json.dumps({**config, "word_embed_proj_dim": None}))
    for stem, keys in halves.items():
        save_file({k[len("model."):]: state[k] for k in keys}, str(folders["sharded"] / f"{stem}.safetensors"),
                  metadata={"format": "pt"})
        torch.save({k: state[k] for k in keys}, folders["sharded_bin"] / f"{stem}.bin")
    for kind, (index, ext) in {"sharded": ("model.safetensors.index.json", "safetensors"),
                               "sharded_bin": ("pytorch_model.bin.index.json", "bin")}.items():
        prefix = len("model.") if kind == "sharded" else 0
        weight_map = {k[prefix:]: f"{stem}.{ext}" for stem, keys in halves.items() for k in keys}
        (folders[kind] / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    stored = {**state, "lm_head.weight": state["model.decoder.embed_tokens.weight"].clone()}
    fc1, q, k = (f"model.decoder.layers.0.{n}.weight" for n in ("fc1", "self_attn.q_proj", "self_attn.k_proj"))
    stored[fc1] = state[fc1].t().contiguous().t()  # column-major, as a transposed-and-saved weight is
    stored[q], stored[k] = torch.cat([state[q], state[k]]).split(len(state[q]))  # views of one fused storage
    torch.save(stored, folders["bin"] / "pytorch_model.bin")
    torch.save(state, folders["legacy_bin"] / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    for folder in folders.values():
        out = tmp_path / f"{folder.name}.pt"
        assert convert_from_hf.main(["--input", str(folder), "--output-shard-name", str(out), "--unflatten-weights",
                                     "-q"]) == 0
        assert convert_to_hf.main(["--input", str(out), "--output", str(tmp_path / f"{folder.name}_back"), "-q"]) == 0
        assert_same_tensors(state, hf_tensors(tmp_path / f"{folder.name}_back"))


def test_sharded_index_naming_a_missing_file_is_refused_in_one_line(tmp_path, capsys):
    make_hf_model(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "hf" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": "part-1.bin"}}))
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "hf"), "--output-shard-name",
                                           str(tmp_path / "out.pt"), "--unflatten-weights"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "pytorch_model.bin.index.json names" in err and "part-1.bin, which does not exist" in err
    assert not (tmp_path / "out.pt").exists()


def _upstream_cfg(hf_cfg, **changes):
    """cfg['model'] as upstream metaseq saves it for OPT: an argparse.Namespace without vocab_size."""
    fields = dict(_name="transformer_lm_megatron", decoder_embed_dim=hf_cfg.hidden_size,
                  decoder_input_dim=hf_cfg.hidden_size, decoder_output_dim=hf_cfg.hidden_size,
                  decoder_layers=hf_cfg.num_hidden_layers, decoder_attention_heads=hf_cfg.num_attention_heads,
                  decoder_ffn_embed_dim=hf_cfg.ffn_dim, max_target_positions=hf_cfg.max_position_embeddings,
                  no_scale_embedding=True, activation_fn="relu", decoder_normalize_before=True,
                  share_decoder_input_output_embed=True, decoder_learned_pos=True)
    return argparse.Namespace(**{**fields, **changes})


def write_real_opt_file(path, hf_model, **cfg_changes):
    """A consolidated real-OPT-like file: Namespace cfg, fp16, fused qkv_proj stored K, V, Q (metaseq's order)."""
    state = {}
    for key, value in hf_model.state_dict().items():
        if key == "lm_head.weight":
            continue
        key = key[len("model."):].replace("final_layer_norm", "layer_norm") if key.startswith("model.decoder.final_") else key[len("model."):]
        state[key] = value.half()
    for i in range(hf_model.config.num_hidden_layers):
        for kind in ("weight", "bias"):
            q, k, v = (state.pop(f"decoder.layers.{i}.self_attn.{n}_proj.{kind}") for n in "qkv")
            state[f"decoder.layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat([k, v, q])
    state["decoder.output_projection.weight"] = state["decoder.embed_tokens.weight"]
    state["decoder.version"] = torch.tensor([3.0]).half()
    cfg = {"model": _upstream_cfg(hf_model.config, **cfg_changes), "common": {"model_parallel_size": 1}}
    atomic_torch_save({"model": state, "cfg": cfg}, path)


@pytest.fixture(scope="module")
def real_opt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("real_opt")
    vocab, merges, bpe = write_gpt2_files(folder)
    hf_model = make_hf_model(folder / "hf_ref", vocab_size=bpe.get_vocab_size() + 5, max_position_embeddings=40, seed=5)
    hf_model = hf_model.half().float()  # what the fp16 file holds
    write_real_opt_file(folder / "reshard-model_part-0.pt", hf_model)
    return folder, vocab, merges, hf_model


def test_real_opt_file_serves_with_gpt2_bpe_like_hf_generate(real_opt, monkeypatch, capsys):
    folder, vocab, merges, hf_model = real_opt
    path = str(folder / "reshard-model_part-0.pt")
    code, err = _run_cli(interactive_cli, ["--path", path], capsys)
    assert code == 2 and "--vocab-filename" in err and "--merges-filename" in err and len(err.splitlines()) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO("what do cats chase?\n"))
    assert interactive_cli.main(["--path", path, "--vocab-filename", vocab, "--merges-filename", merges,
                                 "--max-new-tokens", "12", "--no-stop-at-newline"]) == 0
    (answer,) = capsys.readouterr().out.splitlines()
    assert answer
    tok = BPETokenizer.from_vocab_merges(vocab, merges)
    prompt = torch.tensor([tok.encode("what do cats chase?")])
    out = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=1,
                            suppress_tokens=[0, 1, 3])
    assert answer == tok.decode(out[0, prompt.size(1):].tolist()).strip()


def test_real_opt_file_exports_with_kvq_split_and_equal_logits(real_opt, tmp_path):
    folder, _, _, hf_model = real_opt
    path = str(folder / "reshard-model_part-0.pt")
    assert convert_to_hf.main(["--input", path, "--output", str(tmp_path / "hf"), "-q"]) == 0
    state = hf_tensors(tmp_path / "hf")
    # 14 is the byte tokenizer's newline, not the GPT-2 BPE's: only EOS stops
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2]
    # OPT's BPE: prompts start with </s>, as in Hugging Face's OPT configs (the byte tokenizer's start with <s>, 0)
    assert generation["bos_token_id"] == json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 2
    assert state["model.decoder.layers.1.self_attn.q_proj.weight"].dtype == torch.float16
    assert torch.equal(state["model.decoder.layers.1.self_attn.q_proj.weight"].float(),
                       hf_model.model.decoder.layers[1].self_attn.q_proj.weight)
    exported = OPTForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    ours = build_inference_model(load_checkpoint(path), source=path)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_logits(ours(tokens), exported(tokens).logits)


def test_real_opt_file_without_head_and_version_exports_as_it_serves(real_opt, tmp_path, monkeypatch, capsys):
    folder, vocab, merges, _ = real_opt
    ckpt = load_checkpoint(folder / "reshard-model_part-0.pt")
    del ckpt["model"]["decoder.output_projection.weight"], ckpt["model"]["decoder.version"]
    atomic_torch_save(ckpt, tmp_path / "nohead.pt")
    monkeypatch.setattr(sys, "stdin", io.StringIO("what do cats chase?\n"))
    assert interactive_cli.main(["--path", str(tmp_path / "nohead.pt"), "--vocab-filename", vocab,
                                 "--merges-filename", merges, "--max-new-tokens", "3"]) == 0
    for source, out in ((folder / "reshard-model_part-0.pt", "full"), (tmp_path / "nohead.pt", "nohead")):
        assert convert_to_hf.main(["--input", str(source), "--output", str(tmp_path / out), "-q"]) == 0
    assert_same_tensors(hf_tensors(tmp_path / "full"), hf_tensors(tmp_path / "nohead"))


@pytest.mark.parametrize("change, field", [
    (dict(decoder_input_dim=9), "decoder_input_dim=9"),
    (dict(decoder_normalize_before=False), "decoder_normalize_before=False"),
])
def test_opt_350m_variant_is_refused_everywhere(real_opt, tmp_path, capsys, change, field):
    folder, vocab, merges, hf_model = real_opt
    path = str(tmp_path / "opt350m.pt")
    write_real_opt_file(path, hf_model, **change)
    for module, argv in ((interactive_cli, ["--path", path, "--vocab-filename", vocab, "--merges-filename", merges]),
                         (convert_to_hf, ["--input", path, "--output", str(tmp_path / "hf")])):
        code, err = _run_cli(module, argv, capsys)
        assert code == 2 and field in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_our_fused_qkv_model_exports_q_k_v_blocks_with_equal_logits(tmp_path):
    config = ModelConfig(decoder_layers=2, fused_qkv=True)
    model = build_model(config, seed=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorms and biases away from 1 and 0
    ckpt = {"model": model.state_dict(), "cfg": {"model": config.to_dict()}}
    atomic_torch_save(ckpt, tmp_path / "fused.pt")
    assert convert_to_hf.main(["--input", str(tmp_path / "fused.pt"), "--output", str(tmp_path / "hf"), "-q"]) == 0
    state = hf_tensors(tmp_path / "hf")
    fused = model.decoder.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(state["model.decoder.layers.0.self_attn.q_proj.weight"], fused[:30])
    assert torch.equal(state["model.decoder.layers.0.self_attn.v_proj.weight"], fused[60:])
    tokens = torch.randint(4, 260, (2, 67), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close_logits(model(tokens), OPTForCausalLM.from_pretrained(str(tmp_path / "hf"))(tokens).logits)


def test_model_parallel_part_is_refused_for_export_but_a_merged_file_that_keeps_p_in_cfg_is_not(tmp_path, capsys):
    """Part 0 of 2 holds half of each cut weight; upstream's merged restored.pt holds all of them, though its cfg
    still says model_parallel_size=2."""
    config = ModelConfig(decoder_attention_heads=2, decoder_ffn_embed_dim=76)
    whole = build_model(config, seed=0).state_dict()
    cfg = {"model": config.to_dict(), "common": {"model_parallel_size": 2}}
    atomic_torch_save({"model": {k: split_param(k, v, 2)[0].clone() for k, v in whole.items()}, "cfg": cfg},
                      tmp_path / "part.pt")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "part.pt"), "--output", str(tmp_path / "hf")], capsys)
    assert code == 2 and "model_parallel_size=2" in err and not (tmp_path / "hf").exists()
    assert "reshard_model_parallel" in err and "--num-output-parts 1" in err and len(err.splitlines()) == 1
    atomic_torch_save({"model": whole, "cfg": cfg}, tmp_path / "restored.pt")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "restored.pt"), "--output", str(tmp_path / "hf")],
                         capsys)
    assert code == 0 and torch.equal(hf_tensors(tmp_path / "hf")["model.decoder.embed_tokens.weight"],
                                     whole["decoder.embed_tokens.weight"])


def test_inputs_of_several_model_parts_or_a_folder_are_refused_naming_the_fix(tmp_path, capsys):
    ckpt = {"model": build_model(ModelConfig(), seed=0).state_dict(), "cfg": {"model": ModelConfig().to_dict()}}
    for j in range(2):
        atomic_torch_save(ckpt, tmp_path / f"reshard-model_part-{j}.pt")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "reshard-model_part-*.pt"),
                                         "--output", str(tmp_path / "hf")], capsys)
    assert code == 2 and "matches model parts [0, 1]" in err and "--num-output-parts 1" in err, err
    assert "--input-glob-pattern" not in err  # a flag of reshard_fsdp, not of convert_to_hf
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path), "--output", str(tmp_path / "hf")], capsys)
    assert code == 2 and "it is a folder: name a checkpoint in it" in err and "reshard-model_part-0.pt" in err
    assert not (tmp_path / "hf").exists()


def test_a_file_given_for_the_hf_folder_is_named_as_a_file(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, err = _run_cli(convert_from_hf, ["--input", str(tmp_path / "model.safetensors"), "--output-shard-name",
                                           str(tmp_path / "out.pt")], capsys)
    assert (code, err) == (2, f"ERROR: --input {tmp_path}/model.safetensors is a file; pass a Hugging Face model "
                              "folder (config.json and its weights)")


def test_a_file_that_is_no_checkpoint_or_an_output_under_a_file_is_one_plain_line(tmp_path, capsys):
    atomic_torch_save([1, 2], tmp_path / "list.pt")
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "list.pt"), "--output", str(tmp_path / "hf")],
                         capsys)
    assert (code, err) == (2, f"ERROR: {tmp_path}/list.pt: expected a checkpoint dict, found list")  # no type name
    code, err = _run_cli(convert_to_hf, ["--input", str(tmp_path / "list.pt"), "--output",
                                         str(tmp_path / "list.pt" / "hf")], capsys)
    assert (code, err) == (2, f"ERROR: --output {tmp_path}/list.pt/hf would be in {tmp_path}/list.pt, which is a "
                              "file, not a folder; give a path in a folder")


def test_output_folder_holding_the_inputs_or_the_cwd_is_refused_and_nothing_is_lost(tmp_path, capsys, monkeypatch):
    make_hf_model(tmp_path / "hf", vocab_size=260)
    shards = tmp_path / "w2" / SHARDS
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(shards),
                                 "--num-output-shards", "2", "-q"]) == 0
    glob_ = str(shards).replace("{i}", "*")
    for output in (tmp_path / "w2", tmp_path):  # the inputs' folder, or one above it
        code, err = _run_cli(convert_to_hf, ["--input", glob_, "--output", str(output), "--overwrite"], capsys)
        assert code == 2 and f"--output {output} holds the input" in err and len(err.splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path / "w2")) == [SHARDS.format(i=i) for i in range(2)]
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    code, err = _run_cli(convert_to_hf, ["--input", glob_, "--output", "."], capsys)
    assert code == 2 and "--output . is (or holds) the current folder" in err
    assert os.listdir(".") == []  # no stray temp folder
    code, err = _run_cli(convert_to_hf, ["--input", glob_, "--output", str(tmp_path / "w2" / SHARDS.format(i=0) / "x")],
                         capsys)
    assert code == 2 and f"which is a file, not a folder" in err and ".tmp" not in err


def test_overwrite_replaces_only_a_model_folder_and_keeps_a_tokenizer_copied_in(tmp_path, capsys):
    """--overwrite replaces the whole folder: refused where it holds the user's other files or folders (nothing is
    lost); a tokenizer copied in beside an export of a vocabulary other than the byte tokenizer's is kept."""
    make_hf_model(tmp_path / "hf")  # 61 tokens: no tokenizer files are written
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output-shard-name", str(tmp_path / "c.pt"),
                                 "--unflatten-weights", "-q"]) == 0
    out, argv = tmp_path / "models", ["--input", str(tmp_path / "c.pt"), "--output", str(tmp_path / "models"), "-q"]
    assert convert_to_hf.main(argv) == 0
    exported = sorted(os.listdir(out))
    for extra, make, remove in (("NOTES.txt", lambda p: p.write_text("mine"), os.unlink),
                                ("other_model", os.mkdir, os.rmdir)):
        make(out / extra)
        code, err = _run_cli(convert_to_hf, [*argv, "--overwrite"], capsys)
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--output {out} holds {extra}, which is not part of a Hugging Face model folder" in err
        assert extra in os.listdir(out)
        remove(out / extra)
    for name in ("vocab.json", "merges.txt"):
        (out / name).write_text(f"the model's own {name}")
    assert convert_to_hf.main([*argv, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == sorted([*exported, "vocab.json", "merges.txt"])
    assert (out / "merges.txt").read_text() == "the model's own merges.txt"
    (out / "model.safetensors").write_bytes(b"stale")
    (tmp_path / "link").symlink_to(out)  # --output a link to the folder: the folder is replaced, the link stays
    assert convert_to_hf.main([*argv[:3], str(tmp_path / "link"), "-q", "--overwrite"]) == 0
    assert (tmp_path / "link").is_symlink() and (out / "model.safetensors").read_bytes() != b"stale"


@pytest.mark.parametrize("module", [convert_to_hf, convert_from_hf])
def test_help_shows_examples(module, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"python -m metaseq.scripts.{module.__name__.rsplit('.', 1)[1]}" in out


def test_upstream_namespace_cfg_is_opt_exact_with_vocab_from_the_weights():
    hf_cfg = OPTConfig(word_embed_proj_dim=ODD["hidden_size"], **ODD)
    namespace = _upstream_cfg(hf_cfg)
    direct = ModelConfig.from_dict(namespace)  # no traceback on a Namespace
    assert (direct.no_scale_embedding, direct.position_offset, direct.decoder_embed_dim) == (True, 2, 18)
    state = {"decoder.embed_tokens.weight": torch.empty(1234, 18, device="meta")}
    config = model_config_from_cfg(namespace, state, source="opt.pt")
    assert config.vocab_size == 1234 and config.max_target_positions == ODD["max_position_embeddings"]
    scaled = model_config_from_cfg(_upstream_cfg(hf_cfg, no_scale_embedding=False), state, source="opt.pt")
    assert (scaled.no_scale_embedding, scaled.position_offset) == (False, 2)


def test_real_streaming_runs_shards_and_upstream_restored_file_export_alike(tmp_path, capsys):
    """Upstream's LockingArray (rank 0's data loader state) and the DictConfig of its restored.pt are not needed to
    export: only the weights and cfg['model'] are read, nothing of theirs is run."""
    write_real_runs([(tmp_path / "real", RealRunSpec(2, ema=False, restored=True))])
    for source, out in (("checkpoint_last-model_part-0-shard*.pt", "shards"), ("restored.pt", "restored")):
        assert convert_to_hf.main(["--input", str(tmp_path / "real" / source), "--output", str(tmp_path / out),
                                   "-q"]) == 0, capsys.readouterr().err
    assert_same_tensors(hf_tensors(tmp_path / "shards"), hf_tensors(tmp_path / "restored"))
