"""Inference on resharded output: plain-model loading, FSDP parity, decoding rules."""
import dataclasses
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from torch import nn

from metaseq.distributed.fsdp import init_distributed, lazy_init_all, start_ranks, wrap_model_fsdp
from metaseq.file_io import atomic_torch_save, load_checkpoint
from metaseq.hub_utils import (
    NEWLINE,
    GenerationConfig,
    GeneratorInterface,
    InferenceLoadError,
    build_inference_model,
    generate_ids,
    load_inference_checkpoint,
)
from metaseq.models.transformer_lm import ModelConfig, build_model
from metaseq.scripts.reshard_fsdp import reshard_fsdp_checkpoints
from metaseq.tokenizer import EOS, VOCAB_SIZE, encode

PROMPTS = ["what is the meaning of life?", "what do cats chase?", "why reshard a checkpoint?", "hi"]
W = 4


def _fixed_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, VOCAB_SIZE, (3, 41), generator=g)  # (B, T)


def _glob(folder, prefix="checkpoint_last"):
    return str(folder / f"{prefix}-model_part-0-shard*.pt")


@pytest.fixture(scope="module")
def resharded(trained, tmp_path_factory):
    """The W=4 run's checkpoint_last as: 4 raw shards, 8 and 256 shards (reshard tool), one consolidated file."""
    src, _ = trained[W]
    out = tmp_path_factory.mktemp("resharded")
    dirs = {4: src}
    for m in (8, 256):
        dirs[m] = out / f"w{m}"
        reshard_fsdp_checkpoints(_glob(src), str(dirs[m] / "checkpoint_last-model_part-0-shard{i}.pt"),
                                 num_output_shards=m, skip_optimizer_state=True)  # serving needs no Adam state
    consolidated = out / "reshard-model_part-0.pt"
    reshard_fsdp_checkpoints(_glob(src), str(consolidated), unflatten_weights=True, skip_optimizer_state=True)
    return dirs, consolidated


def _fsdp_logits_worker(rank: int, shard_files: list, init_method: str, out_path: str) -> None:
    device = init_distributed(rank, len(shard_files), init_method)
    try:
        ckpt = load_checkpoint(shard_files[rank])
        model = wrap_model_fsdp(build_model(ModelConfig.from_dict(ckpt["cfg"]["model"])), device)
        lazy_init_all(model)
        model.load_local_state_dict(ckpt["model"])
        model.eval()
        with torch.no_grad():
            logits = model(_fixed_input().to(device))  # every rank joins the all-gathers
        if rank == 0:
            torch.save(logits.cpu(), out_path)
    finally:
        dist.destroy_process_group()


def test_fsdp_sharded_logits_match_consolidated_model(resharded, tmp_path):
    dirs, consolidated = resharded
    files = [str(dirs[W] / f"checkpoint_last-model_part-0-shard{r}.pt") for r in range(W)]
    out_path = str(tmp_path / "fsdp_logits.pt")
    init_method = "file://" + str(tmp_path / "rendezvous")
    start_ranks(_fsdp_logits_worker, (files, init_method, out_path), W)
    fsdp_logits = torch.load(out_path)
    for path in (str(consolidated), str(dirs[W] / "checkpoint_last.pt")):  # file, and shards in memory
        model = GeneratorInterface.from_checkpoint(path).model
        assert not any(isinstance(m, FSDP) for m in model.modules())
        with torch.no_grad():
            logits = model(_fixed_input())
        assert logits.shape == fsdp_logits.shape == (3, 41, VOCAB_SIZE)
        torch.testing.assert_close(logits, fsdp_logits, rtol=0, atol=1e-5)


def test_greedy_generations_identical_from_4_8_and_256_shards(resharded):
    dirs, consolidated = resharded
    cfg = GenerationConfig(max_new_tokens=20)
    reference = GeneratorInterface.from_checkpoint(str(consolidated))
    expected = reference.generate(PROMPTS, cfg)
    assert any(expected)  # something was generated
    ref_state = reference.model.state_dict()
    for m, folder in dirs.items():
        gen = GeneratorInterface.from_checkpoint(_glob(folder))
        assert gen.generate(PROMPTS, cfg) == expected, m
        for key, value in gen.model.state_dict().items():
            assert torch.equal(value, ref_state[key]), (m, key)


def test_shards_load_by_stem_glob_and_single_shard_path(resharded):
    dirs, _ = resharded
    by_stem = load_inference_checkpoint(str(dirs[8] / "checkpoint_last.pt"))
    by_glob = load_inference_checkpoint(_glob(dirs[8]))
    assert set(by_stem["model"]) == set(by_glob["model"])
    assert "decoder.output_projection.weight" in by_stem["model"]  # the tie is restored
    with pytest.raises(InferenceLoadError, match="still flat.*--unflatten-weights True"):
        GeneratorInterface.from_checkpoint(str(dirs[8] / "checkpoint_last-model_part-0-shard3.pt"))


def test_quoted_tilde_in_path_means_the_home_folder(resharded, monkeypatch):
    dirs, consolidated = resharded
    monkeypatch.setenv("HOME", str(consolidated.parent))
    by_file = load_inference_checkpoint(f"~/{consolidated.name}")
    by_stem = load_inference_checkpoint(f"~/{dirs[8].name}/checkpoint_last.pt")
    assert set(by_file["model"]) == set(by_stem["model"]) and "decoder.output_projection.weight" in by_file["model"]


def test_a_folder_named_with_brackets_is_a_name_not_a_pattern(resharded, tmp_path):
    """`run[1]/...` names that folder (a glob would read '[1]' as the character class of '1')."""
    dirs, consolidated = resharded
    folder = tmp_path / "run[1]"
    folder.mkdir()
    (folder / consolidated.name).symlink_to(consolidated)
    for i in range(4):
        name = f"checkpoint_last-model_part-0-shard{i}.pt"
        (folder / name).symlink_to(dirs[4] / name)
    by_file = load_inference_checkpoint(str(folder / consolidated.name))
    for path in (folder / "checkpoint_last.pt", folder / "checkpoint_last-model_part-0-shard*.pt"):  # stem, glob
        assert set(load_inference_checkpoint(str(path))["model"]) == set(by_file["model"])


def test_flat_consolidated_file_error_lists_keys_and_suggests_unflatten(resharded, tmp_path):
    """The suggested command works, also for a flat file of the name it would write."""
    dirs, _ = resharded
    flat = tmp_path / "reshard-model_part-0.pt"
    reshard_fsdp_checkpoints(_glob(dirs[W]), str(flat), skip_optimizer_state=True)
    with pytest.raises(InferenceLoadError) as info:
        GeneratorInterface.from_checkpoint(str(flat))
    msg = str(info.value)
    assert "still flat" in msg and "flat_param_0" in msg and "decoder.embed_tokens.weight" in msg
    assert "\n" not in msg
    command = shlex.split(re.search(r"python -m metaseq.scripts.reshard_fsdp .*--skip-optimizer-state True", msg)[0])
    subprocess.run([sys.executable, *command[1:]], check=True, capture_output=True)
    assert GeneratorInterface.from_checkpoint(str(tmp_path / "unflattened" / flat.name)).model is not None


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_mismatched_keys_are_listed(resharded, change):
    _, consolidated = resharded
    ckpt = load_checkpoint(consolidated)
    if change == "missing":
        del ckpt["model"]["decoder.layers.1.fc2.bias"]
    else:
        ckpt["model"]["decoder.layers.7.fc2.bias"] = torch.zeros(30)
    with pytest.raises(InferenceLoadError, match=rf"{change} keys \[decoder\.layers\.[17]\.fc2\.bias\]"):
        build_inference_model(ckpt, source="x.pt")


def test_missing_path_names_what_to_pass(tmp_path):
    words = r"checkpoint_last.pt: no such file, nor shards of a save by that name \(.*checkpoint_last-model_part-0-"
    with pytest.raises(InferenceLoadError, match=words):
        GeneratorInterface.from_checkpoint(str(tmp_path / "checkpoint_last.pt"))
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "reshard-model_part-0.pt").write_bytes(b"")
    for shard in ("checkpoint_4-model_part-0-shard0.pt", "checkpoint_4-model_part-0-shard1.pt"):
        (folder / shard).write_bytes(b"")
    with pytest.raises(InferenceLoadError) as error:
        GeneratorInterface.from_checkpoint(str(folder))
    assert str(error.value) == (f"--path {folder}; it is a folder: name a checkpoint in it, e.g. {folder}/checkpoint_4.pt, "
                                f"{folder}/reshard-model_part-0.pt")


def test_wrapper_segments_in_keys_are_tolerated(resharded, tmp_path):
    _, consolidated = resharded
    ckpt = load_checkpoint(consolidated)
    ckpt["model"] = {f"_fsdp_wrapped_module.{k}": v for k, v in ckpt["model"].items()}
    path = tmp_path / "wrapped.pt"
    atomic_torch_save(ckpt, path)
    assert GeneratorInterface.from_checkpoint(str(path)).generate(PROMPTS[:1]) == \
        GeneratorInterface.from_checkpoint(str(consolidated)).generate(PROMPTS[:1])


def test_batched_prompts_decode_like_single_prompts(resharded):
    gen = GeneratorInterface.from_checkpoint(str(resharded[1]))
    cfg = GenerationConfig(max_new_tokens=15)
    assert gen.generate(PROMPTS, cfg) == [gen.generate([p], cfg)[0] for p in PROMPTS]
    with pytest.raises(ValueError, match="generate takes a list of prompt strings"):
        gen.generate(PROMPTS[0], cfg)  # a string: one answer per character
    assert gen.generate(iter(PROMPTS), cfg) == gen.generate(PROMPTS, cfg)


def test_sampling_is_reproducible_per_seed_and_tiny_top_p_is_greedy(resharded):
    gen = GeneratorInterface.from_checkpoint(str(resharded[1]))
    hot = GenerationConfig(max_new_tokens=20, sampling=True, temperature=3.0, seed=7)
    first = gen.generate(PROMPTS, hot)
    assert gen.generate(PROMPTS, hot) == first
    others = {tuple(gen.generate(PROMPTS, dataclasses.replace(hot, seed=s))) for s in range(3)}
    assert len(others) > 1
    nucleus = GenerationConfig(max_new_tokens=20, sampling=True, temperature=3.0, top_p=1e-6, seed=7)
    assert gen.generate(PROMPTS, nucleus) == gen.generate(PROMPTS, GenerationConfig(max_new_tokens=20))


class _ScriptedLM(nn.Module):
    """Predicts `script[k]` as the k-th new token (whatever the input), as one-hot logits."""

    def __init__(self, script: list[int], prompt_len: int, max_positions: int = 67):
        super().__init__()
        self.script, self.prompt_len = script, prompt_len
        self.cfg = ModelConfig(max_target_positions=max_positions)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        logits = torch.zeros(B, T, VOCAB_SIZE)
        k = T - self.prompt_len
        logits[:, -1, self.script[min(k, len(self.script) - 1)]] = 1.0
        return logits


@pytest.mark.parametrize(
    "stop_at_newline, max_new, expected",
    [(True, 10, "ab"), (False, 10, "ab\ncd"), (False, 3, "ab\n")],
)
def test_decoding_stops_at_newline_eos_or_budget(stop_at_newline, max_new, expected):
    script = encode("ab\ncd", bos=False) + [EOS] + encode("zz", bos=False)
    prompt = encode("q?")
    model = _ScriptedLM(script, len(prompt))
    cfg = GenerationConfig(max_new_tokens=max_new, stop_at_newline=stop_at_newline)
    (ids,) = generate_ids(model, [prompt], cfg)
    assert ids == encode(expected, bos=False)
    assert NEWLINE == encode("\n", bos=False)[0]


def test_decoding_stops_when_the_context_is_full():
    prompt = encode("x" * 60)  # 61 tokens, 6 positions left in a 67-position model
    (ids,) = generate_ids(_ScriptedLM(encode("y", bos=False), len(prompt)), [prompt], GenerationConfig(max_new_tokens=50))
    assert len(ids) == 67 - 61


def test_too_long_prompt_and_bad_flags_are_value_errors():
    model = _ScriptedLM([EOS], 1)
    with pytest.raises(ValueError, match="a prompt of 70 tokens does not fit"):
        generate_ids(model, [encode("x" * 69)], GenerationConfig())
    for bad, flag in [(dict(top_p=0.0), "--top-p"), (dict(temperature=0.0), "--temperature"),
                      (dict(max_new_tokens=0), "--max-new-tokens"),
                      (dict(max_new_tokens="5"), "--max-new-tokens='5': must be an integer"),
                      (dict(seed=1.5), "--seed=1.5: must be an integer"),
                      (dict(sampling=1), "--sampling=1: must be True")]:
        with pytest.raises(ValueError, match=flag):
            GenerationConfig(**bad).validate()


def test_incomplete_shard_set_is_refused_before_loading(resharded, tmp_path):
    dirs, _ = resharded
    for r in (0, 1, 3):
        name = f"checkpoint_last-model_part-0-shard{r}.pt"
        shutil.copy(dirs[W] / name, tmp_path / name)
    with pytest.raises(InferenceLoadError, match=r"shard2 is missing: found 3 shard files .* shard indices must be exactly 0..2"):
        load_inference_checkpoint(str(tmp_path / "checkpoint_last.pt"))


def test_tied_weights_that_differ_are_refused(resharded):
    ckpt = load_checkpoint(resharded[1])
    ckpt["model"]["decoder.output_projection.weight"] = ckpt["model"]["decoder.output_projection.weight"] + 1.0
    with pytest.raises(InferenceLoadError, match="'decoder.embed_tokens.weight' and 'decoder.output_projection.weight' are tied"):
        build_inference_model(ckpt, source="x.pt")
