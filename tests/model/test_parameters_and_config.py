"""A model's parameters and its config: the counts against their formulas (the paper's 384 prior parameters
among them), a shared prior, the optimizer's groups, a model saved and loaded back, a bad ModelConfig named in
one line with what is allowed."""

import pytest
import torch

from bam.checkpoint import load_model, save_model
from model import PE_CHOICES, ModelConfig, Transformer
from tiny_models import batch, tiny_config, tiny_model


@pytest.mark.parametrize("pe,ssmax,per_layer,kv", [("bam", True, True, 0), ("bam", False, False, 2),
                                                  ("rope", False, True, 2), ("sinusoidal", True, True, 0)])
def test_parameter_count_matches_formula(pe, ssmax, per_layer, kv):
    cfg = tiny_config(pe, ssmax=ssmax, bam_per_layer=per_layer, n_kv_head=kv, bam_train_loc=True)
    d, L, H, V, hidden = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.vocab_size, 2 * cfg.n_embd
    kv_width = (kv or H) * (d // H)
    per_block = d * d + 2 * d * kv_width + d * d + 3 * d * hidden + 2 * d  # q,k,v,o; SwiGLU; two norms
    expected = 2 * V * d + L * per_block + d  # embedding + untied head + blocks + final norm
    if pe == "bam":
        expected += 3 * H * (L if per_layer else 1)  # shape, log-scale, location
    if ssmax:
        expected += H * L
    assert Transformer(cfg).num_params() == expected


def test_paper_prior_parameter_count():
    """384 trainable prior parameters for the 12-layer, 16-head model (docs/paper.md §2)."""
    model = Transformer(ModelConfig.preset("121m", vocab_size=128, n_embd=64, pe="bam"))
    trainable = sum(p.numel() for prior in model.priors for p in prior.parameters() if p.requires_grad)
    assert trainable == 2 * 16 * 12 == 384


def test_shared_prior_has_one_set_of_parameters():
    model = Transformer(tiny_config("bam", bam_per_layer=False))
    assert len(model.priors) == 1
    assert model.prior_summary()["bam_shape"] == [[1.0] * 4]


def test_optimizer_groups_cover_every_trainable_parameter_once():
    model = Transformer(tiny_config("bam", ssmax=True))
    groups = {g["name"]: g for g in model.optim_groups(0.1)}
    ids = [id(p) for g in groups.values() for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert groups["decay"]["weight_decay"] == 0.1
    assert groups["prior"]["weight_decay"] == groups["no_decay"]["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in groups["decay"]["params"])
    assert len(groups["prior"]["params"]) == 2 * 2 + 2  # shape + log-scale per layer, SSMax per layer


def test_load_model_from_file_and_run_dir(tmp_path):
    model = tiny_model(pe="bam", ssmax=True)
    (tmp_path / "checkpoints").mkdir()
    save_model(model, tmp_path / "checkpoints" / "step_00000010.pt")
    idx, _ = batch()
    for path in (tmp_path / "checkpoints" / "step_00000010.pt", tmp_path):
        loaded = load_model(str(path), attn_impl="eager")
        assert loaded.config.attn_impl == "eager"
        with torch.no_grad():
            torch.testing.assert_close(loaded(idx)[0], model(idx)[0])
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_model(str(tmp_path / "nothing"))


@pytest.mark.parametrize("kw,match", [
    (dict(pe="xpos"), "allowed: " + ", ".join(PE_CHOICES)),
    (dict(attn_impl="flash"), "allowed: auto, flex, sdpa, eager"),
    (dict(n_head=5), "must divide n_embd"),
    (dict(n_kv_head=3), "must divide n_head"),
    (dict(bam_init="zeros"), "allowed: alibi, uniform"),
    (dict(flex_prior="fast"), "unknown flex_prior 'fast'; allowed: table, formula"),
])
def test_bad_config_names_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kw)
