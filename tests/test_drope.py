"""DroPE's recipe end to end on a tiny run (issue 58, docs/training.md "Dropping RoPE after pretraining"): a RoPE
run trained, then recalibrated with its RoPE dropped (train.init_from + train.init_change_pe) as NoPE, as NoPE with
QK-norm and as BAM + SSMax, each starting from the RoPE run's weights with only the new parameters at their
initialisation, saying in one line what it drops and what replaces it, and evaluated."""

import glob
import os

import pytest
import torch

import train
from bam.config import load_config
from eval import passkey
from small_runs import newest, small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHORT = ["--train.warmup_steps=0", "--train.val_every=0", "--model.attn_impl=sdpa"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "drope", "*.toml"))
                                  + glob.glob(os.path.join(ROOT, "configs", "repro", "drope_*.toml"))))
def test_every_drope_config_drops_rope_for_a_budget_of_its_own(path):
    """configs/drope/ (the paper's RoPE run) and configs/repro/drope_*.toml (the CPU grid's, whose init_from drope.sh
    gives per seed): another encoding than RoPE, allowed to change it, a schedule of its own without weight
    decay, and a run directory apart from its source."""
    cfg = load_config(path)
    source = load_config(os.path.join(ROOT, "configs", "paper" if "/drope/" in path else "repro", "rope" +
                                      ("_512" if "/drope/" in path else "") + ".toml"))
    assert cfg.model.pe != "rope" and source.model.pe == "rope" and cfg.train.init_change_pe
    assert cfg.train.max_steps < source.train.max_steps and cfg.train.lr < source.train.lr
    assert cfg.train.weight_decay == 0 and cfg.model.block_size == source.model.block_size
    if "/drope/" in path:
        assert cfg.train.init_from == source.log.out_dir != cfg.log.out_dir
        assert os.path.basename(path) == f"{cfg.model.pe}{'_qk_norm' if cfg.model.qk_norm else ''}" \
            f"{'_ssmax' if cfg.model.ssmax else ''}_{cfg.model.block_size}.toml"


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory, synthetic):
    folder = tmp_path_factory.mktemp("drope")
    cfg = small_config(folder, synthetic)
    run = str(folder / "rope")
    train.main([cfg, "--model.pe=rope", "--model.ssmax=false", f"--log.out_dir={run}", "--train.max_steps=4", *SHORT])
    return folder, cfg, run


@pytest.mark.slow  # train.py and an evaluator end to end
@pytest.mark.parametrize("name,change,replacement,added", [
    ("nope", ["--model.pe=nope", "--model.ssmax=false"], "nope", []),
    ("nope_qk_norm", ["--model.pe=nope", "--model.ssmax=false", "--model.qk_norm=true"], "nope + qk_norm",
     ["blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.weight"]),
    ("bam_ssmax", ["--model.pe=bam", "--model.ssmax=true"], "bam + ssmax",
     ["priors.0.shape", "priors.1.log_scale", "blocks.0.attn.ssmax_scale"]),
    # the prior started flat (bam.config.INITIALISATION_MODEL_KEYS: where added parameters start)
    ("bam_ssmax_uniform", ["--model.pe=bam", "--model.ssmax=true", "--model.bam_init=uniform"], "bam + ssmax",
     ["priors.0.shape", "priors.1.log_scale", "blocks.0.attn.ssmax_scale"]),
])
def test_a_rope_run_is_recalibrated_without_rope_and_evaluated(rope_run, monkeypatch, capsys, name, change,
                                                                replacement, added):
    folder, cfg, source_dir = rope_run
    source = newest(source_dir)["model"]
    built = {}
    build_model = train.build_model

    def recording(*args, **kwargs):  # the model as the recalibration starts it
        model, optimizer, base_lr = build_model(*args, **kwargs)
        built["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        return model, optimizer, base_lr
    monkeypatch.setattr(train, "build_model", recording)
    out = str(folder / name)
    capsys.readouterr()
    train.main([cfg, *change, f"--train.init_from={source_dir}", "--train.init_change_pe=true",
                f"--log.out_dir={out}", "--train.max_steps=2", *SHORT])
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith("dropping")]
    assert len(lines) == 1 and lines[0].startswith(f"dropping pe = 'rope', which the weights of ") \
        and f"for {replacement}: recalibrating for 2 steps" in lines[0], printed
    weights = built["weights"]
    assert all(torch.equal(weights[k], v) for k, v in source.items())  # every RoPE-trained tensor carried over
    new = sorted(set(weights) - set(source))
    assert all(k in new for k in added) and (new == []) == (added == [])
    flat = "--model.bam_init=uniform" in change
    for k in new:  # SSMax's scales, QK-norm's gains at 1; BAM's prior at ALiBi's init (shape 1) or flat (shape 0)
        if k.endswith(("ssmax_scale", "norm.weight", ".shape")):
            start = 0.0 if flat and k.endswith(".shape") else 1.0
            assert torch.equal(weights[k], torch.full_like(weights[k], start)), k
    recalibrated = newest(out)
    assert recalibrated["step"] == 2 and recalibrated["model_config"]["pe"] == change[0].split("=")[1]
    assert passkey.main([out, "--lengths", "64,128", "--samples", "2", "--digits", "2", "--no_progress"]) == 0
    assert os.path.exists(os.path.join(out, "eval", "passkey.json"))


@pytest.mark.slow
def test_dropping_rope_without_saying_so_is_refused_in_one_line(rope_run, capsys):
    folder, cfg, source_dir = rope_run
    out = str(folder / "refused")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main([cfg, "--model.pe=nope", "--model.ssmax=false", f"--train.init_from={source_dir}",
                    f"--log.out_dir={out}", "--train.max_steps=2", *SHORT])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with pe = 'rope'" in err and "--train.init_change_pe=true" in err
    assert not os.path.exists(out)
