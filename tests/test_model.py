"""The model is OPT-exact by default, and checkpoints of the earlier variant still load as what they are."""
import math
from pathlib import Path

import pytest
import torch

from metaseq.file_io import load_checkpoint
from metaseq.hub_utils import build_inference_model
from metaseq.models.transformer_lm import PRE_OPT_EXACT, ModelConfig, build_model

# Written by the code before the OPT-exact change (embeddings times sqrt(d), no position
# offset): a 1-layer model's consolidated weights, its cfg["model"] (without the new
# fields), a token batch and the logits that code computed for it.
PRE_OPT_EXACT_FILE = Path(__file__).parent / "data" / "pre_opt_exact_model.pt"
TINY = dict(decoder_layers=1, decoder_embed_dim=6, decoder_attention_heads=2, decoder_ffn_embed_dim=7,
            max_target_positions=9)


def _layer0_input(model, tokens: torch.Tensor) -> torch.Tensor:
    """What the first decoder layer receives: the embedded tokens plus positions (B, T, C)."""
    seen = []
    handle = model.decoder.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(tokens)
    handle.remove()
    return seen[0]


def test_pre_opt_exact_checkpoint_gives_the_logits_it_gave_before():
    ckpt = load_checkpoint(PRE_OPT_EXACT_FILE)
    assert "no_scale_embedding" not in ckpt["cfg"]["model"]
    model = build_inference_model(ckpt, source=str(PRE_OPT_EXACT_FILE))
    assert model.cfg.no_scale_embedding is False and model.cfg.position_offset == 0
    assert model.decoder.embed_positions.weight.shape == (9, 6)
    with torch.no_grad():
        logits = model(ckpt["tokens"])
    # The stored logits came from another CPU, whose matmul kernels sum in another order (about 1e-7 apart);
    # the other variant (no scale, offset positions) is about 0.3 off.
    torch.testing.assert_close(logits, ckpt["logits"], rtol=0, atol=1e-6)


def test_pre_opt_exact_model_scales_embeddings_and_has_no_offset():
    model = build_model(ModelConfig.from_dict(dict(TINY)), seed=0).eval()
    tokens = torch.tensor([[0, 50, 7]])
    dec = model.decoder
    expected = math.sqrt(6) * dec.embed_tokens.weight[tokens] + dec.embed_positions.weight[:3]
    torch.testing.assert_close(_layer0_input(model, tokens), expected.detach())


def test_new_default_is_opt_exact_no_scale_and_positions_offset_by_two():
    cfg = ModelConfig(**TINY)
    assert cfg.to_dict()["no_scale_embedding"] is True and cfg.to_dict()["position_offset"] == 2
    model = build_model(cfg, seed=0).eval()
    dec = model.decoder
    assert dec.embed_positions.weight.shape == (9 + 2, 6)
    tokens = torch.tensor([[0, 50, 7, 9]])
    expected = dec.embed_tokens.weight[tokens] + dec.embed_positions.weight[2:6]
    torch.testing.assert_close(_layer0_input(model, tokens), expected.detach())
    # Rows 0 and 1 exist (checkpoints keep them) but no position reads them.
    before = model(tokens).detach()
    with torch.no_grad():
        dec.embed_positions.weight[:2] += 5.0
    torch.testing.assert_close(model(tokens).detach(), before, rtol=0, atol=0)
    with torch.no_grad():
        dec.embed_positions.weight[2] += 5.0
    assert not torch.allclose(model(tokens)[0, 0], before[0, 0])


def test_new_config_round_trips_through_its_dict():
    cfg = ModelConfig(**TINY)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    old = ModelConfig.from_dict({**TINY, "unknown_key": 1})
    assert (old.no_scale_embedding, old.position_offset) == (PRE_OPT_EXACT["no_scale_embedding"], 0)


def test_upstream_metaseq_cfg_without_position_offset_gets_opts_offset():
    cfg = ModelConfig.from_dict({**TINY, "no_scale_embedding": True, "_name": "transformer_lm_megatron"})
    assert cfg.position_offset == 2


def test_negative_position_offset_is_refused():
    with pytest.raises(ValueError, match="position_offset=-1"):
        build_model(ModelConfig(**TINY, position_offset=-1))


def test_a_sequence_longer_than_the_position_table_is_refused():
    model = build_model(ModelConfig(**TINY), seed=0)
    assert model(torch.zeros(1, 9, dtype=torch.long)).shape == (1, 9, model.cfg.vocab_size)
    with pytest.raises(ValueError, match="sequence of 10 tokens is longer than the model's max_target_positions=9"):
        model(torch.zeros(1, 10, dtype=torch.long))


def test_fused_qkv_checkpoint_serves_and_equals_the_separate_model():
    """cfg["model"]["fused_qkv"] builds one qkv_proj ([q; k; v]); from one seed it is the separate model's function."""
    fused, separate = (build_model(ModelConfig(**TINY, fused_qkv=f), seed=5).eval() for f in (True, False))
    ckpt = {"model": fused.state_dict(), "cfg": {"model": fused.cfg.to_dict()}}
    served = build_inference_model(ckpt, source="fused.pt")
    assert served.decoder.layers[0].self_attn.qkv_proj.weight.shape == (18, 6)
    assert not hasattr(served.decoder.layers[0].self_attn, "q_proj")
    q = separate.decoder.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(served.decoder.layers[0].self_attn.qkv_proj.weight[:6], q, rtol=0, atol=0)
    tokens = torch.tensor([[0, 50, 7, 9, 100]])
    with torch.no_grad():
        torch.testing.assert_close(served(tokens), separate(tokens), rtol=0, atol=1e-6)
