"""config.py: defaults are the paper's run, file and command line override them in that order,
every mistake is one ConfigError naming what is allowed, and every shipped config resolves."""

import dataclasses
import glob
import os
import re
import tomllib

import pytest

from bam.config import ConfigError, check, load_config, to_dict, to_toml, upgrade
from model import ENCODINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "paper", "**", "*.toml"), recursive=True))


EXTRA_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "extra", "*.toml")))


def test_extra_configs_are_the_paper_settings_with_another_encoding():
    """configs/extra: encodings beyond the paper's (from model.PRIORS), or per-layer patterns of them named
    after the design, at the paper's 512 settings."""
    from model import PRIORS

    assert EXTRA_CONFIGS
    patterns = []
    for path in EXTRA_CONFIGS:
        cfg = load_config(path)
        name = os.path.basename(path)
        if cfg.model.layer_pattern:
            patterns.append(name)
            assert name.endswith(f"_{cfg.model.block_size}.toml"), path
            assert len({kind.pe for kind in cfg.model.layer_kinds}) > 1, path  # a pattern of several encodings
        else:
            assert cfg.model.pe in PRIORS, path
            assert name == f"{cfg.model.pe}{'_ssmax' if cfg.model.ssmax else ''}_{cfg.model.block_size}.toml", path
        assert (cfg.train.tokens_per_step, cfg.train.optimizer, cfg.model.n_layer) == (589_824, "radam", 12), path
    assert patterns == ["bam_ssmax_global_512.toml", "rnope_swa_512.toml"]  # issue 47's two designs


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_the_papers_headline_run():
    cfg = load_config()
    m, d, t = cfg.model, cfg.data, cfg.train
    assert (m.n_layer, m.n_embd, m.n_head, m.block_size) == (12, 768, 16, 512)
    assert (m.pe, m.bam_init, m.bam_per_layer) == ("bam", "alibi", True)
    assert (t.optimizer, t.betas, t.weight_decay, t.lr, t.warmup_steps) == ("radam", (0.9, 0.95), 0.1, 1e-3, 0)
    assert (t.decay, t.min_lr_frac, t.grad_clip) == ("cosine", 0.1, 1.0)
    assert (t.tokens_per_step, t.max_steps, d.doc_mask, t.prior_lr) == (589_824, 20_000, True, None)
    assert cfg.log.wandb == "disabled"
    check(cfg, world_size=8)  # the default batch fits one 8-GPU node


def test_a_layer_pattern_from_a_file_or_the_command_line_round_trips(tmp_path):
    path = write(tmp_path, '[model]\npe = "rope"\nn_layer = 4\nlayer_pattern = "rope@256*3 nope@full"\n')
    cfg = load_config(path)
    assert [k.window for k in cfg.model.layer_kinds] == [256, 256, 256, 0]
    assert load_config(write(tmp_path, to_toml(cfg), "resolved.toml")).model == cfg.model
    cfg = load_config(path, ["--model.layer_pattern=rope@64 rope@64 bam+ssmax@full", "--model.n_layer=6"])
    assert [k.pe for k in cfg.model.layer_kinds] == ["rope", "rope", "bam"] * 2
    with pytest.raises(ConfigError, match=r"^\[model\] layer_pattern 'rope bam' describes 2 layers, which does "
                                          r"not divide n_layer=3"):
        load_config(path, ["--model.layer_pattern=rope bam", "--model.n_layer=3"])


def test_file_then_command_line_override_defaults(tmp_path):
    path = write(tmp_path, '[model]\npe = "rope"\nn_layer = 4\n[train]\nlr = 3e-4\nbetas = [0.8, 0.9]\n')
    cfg = load_config(path, ["--model.n_layer=2", "--train.prior_lr=1e-2", "--log.run_name=007",
                             "--data.doc_mask=false", "--model.ssmax=true"])
    assert (cfg.model.pe, cfg.model.n_layer, cfg.model.ssmax) == ("rope", 2, True)
    assert (cfg.train.lr, cfg.train.betas, cfg.train.prior_lr, cfg.data.doc_mask) == (3e-4, (0.8, 0.9), 1e-2, False)
    assert cfg.log.run_name == "007"  # text fields take the command line verbatim
    assert cfg.log.out_dir == os.path.join("runs", "run")  # one run dir per config file by default
    assert load_config(path, ["--train.prior_lr=none"]).train.prior_lr is None
    assert load_config(path, ["--train.lr=1"]).train.lr == 1.0  # an integer is a fine float


def test_preset_sets_the_size_and_explicit_keys_win(tmp_path):
    cfg = load_config(write(tmp_path, '[model]\npreset = "275m"\nn_layer = 3\n'))
    assert (cfg.model.n_embd, cfg.model.n_head, cfg.model.n_layer) == (1152, 24, 3)
    with pytest.raises(ConfigError, match="121m"):
        load_config(None, ["--model.preset=huge"])


@pytest.mark.parametrize("text,overrides,expected", [
    ("[optim]\nlr = 1\n", [], r"unknown section \[optim\].*allowed sections: \[model\], \[data\], \[train\], \[log\]"),
    ("[train]\nlrr = 1\n", [], r"unknown key 'lrr' in \[train\].*allows: tokens_per_step, max_steps, optimizer, lr"),
    ("", ["--model.heads=4"], r"unknown key 'heads' in \[model\].*allows: preset, vocab_size, n_layer, n_head"),
    ("", ["--optim.lr=1"], r"unknown section.*allowed sections: model, data, train, log"),
    ("[train]\nmax_steps = 1.5\n", [], r"\[train\] max_steps = 1.5.*expected an integer"),
    ("", ["--train.max_steps=ten"], r"\[train\] max_steps = 'ten'.*expected an integer"),
    ("", ["--train.compile=yes"], r"expected true or false"),
    ("", ["--train.betas=0.9"], r"expected a list"),
    ("", ["--train.betas=[0.9]"], r"expected a list of 2 values"),
    ("", ["--train.optimizer=sgd"], r"optimizer = 'sgd'.*choose one of: radam, adamw"),
    ("", ["--log.wandb=on"], r"choose one of: disabled, offline, online"),
    ("", ["--model.pe=xpos"], r"\[model\].*xpos.*" + re.escape(", ".join(ENCODINGS))),
    ("", ["--train.lr"], r"overrides look like --section.key=value"),
    ("", ["--train.tokens_per_step=1000"],
     r"tokens_per_step = 1000 is not a multiple of data.batch_size x model.block_size x world size = 48 x 512 x 1"),
    ("", ["--train.warmup_steps=30000"], r"warmup_steps = 30000 is more than train.max_steps = 20000"),
    ("", ["--train.min_lr_frac=2"], r"train.min_lr_frac = 2.0: allowed: a finite number >= 0, <= 1"),
    ("", ["--train.lr=0"], r"train.lr = 0.0: allowed: a finite number > 0"),
    ("[train\n", [], r"not valid TOML"),
])
def test_mistakes_are_one_clear_error(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(write(tmp_path, text), overrides)
    assert "\n" not in str(info.value)


def test_the_old_train_doc_mask_reads_as_data_doc_mask(tmp_path):
    """Before data.doc_mask it was train.doc_mask: an old config file, command line or saved config (a run
    directory's config.toml, a checkpoint's "config") resolves to the config a new run writes."""
    new = load_config(None, ["--data.doc_mask=false", "--log.out_dir=runs/x"])
    old_text = to_toml(new).replace("doc_mask = false\n", "", 1).replace("[train]\n", "[train]\ndoc_mask = false\n")
    assert "[train]\ndoc_mask = false" in old_text and old_text.count("doc_mask") == 1
    assert load_config(write(tmp_path, old_text)) == new
    assert load_config(None, ["--train.doc_mask=false", "--log.out_dir=runs/x"]) == new
    saved = to_dict(new)
    saved["train"]["doc_mask"] = saved["data"].pop("doc_mask")
    assert upgrade(saved) == to_dict(new) and "doc_mask" in saved["train"]  # a copy: the input is left alone
    with pytest.raises(ConfigError, match=r"train.doc_mask is the old name of data.doc_mask, and both are set"):
        load_config(write(tmp_path, "[train]\ndoc_mask = false\n[data]\ndoc_mask = true\n"))
    assert not load_config(write(tmp_path, "[train]\ndoc_mask = false\n[data]\ndoc_mask = false\n")).data.doc_mask


def test_the_checkpoint_changes_table_names_real_keys():
    """One table says what may differ from a checkpoint; both views of it (resume, same weights) come from it."""
    from bam.config import CHANGEABLE_ON_RESUME, CHECKPOINT_CHANGES, SECTIONS, SHAPE_FREE_MODEL_KEYS

    for section, keys in CHECKPOINT_CHANGES.items():
        assert set(keys) <= {f.name for f in dataclasses.fields(SECTIONS[section])}, section
        assert set(keys.values()) <= {"resume", "weights"}
    assert "block_size" in SHAPE_FREE_MODEL_KEYS and "block_size" not in CHANGEABLE_ON_RESUME["model"]
    assert set(CHANGEABLE_ON_RESUME["model"]) <= set(SHAPE_FREE_MODEL_KEYS)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))


def test_batch_that_cannot_split_over_the_ranks_names_the_batch_sizes_that_can():
    cfg = load_config(None, ["--data.batch_size=36"])
    with pytest.raises(ConfigError, match=r"36 x 512 x 3 = 55296; data.batch_size values that fit: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32$"):
        check(cfg, world_size=3)
    check(cfg, world_size=4)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["--model.pe=alibi", "--train.prior_lr=0.01", "--log.run_name=a \"quoted\" name\\",
                             "--train.betas=[0.9, 0.99]", "--log.out_dir=runs/x"])
    text = to_toml(cfg)
    tomllib.loads(text)  # valid TOML
    assert load_config(write(tmp_path, text)) == cfg
    # None has no TOML spelling: written as a comment, read back as the default
    assert load_config(write(tmp_path, to_toml(load_config()), "b.toml")).train.prior_lr is None


def test_tiny_config_is_small():
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.toml"))
    assert cfg.model.n_layer <= 4 and cfg.model.n_embd <= 128 and not cfg.train.compile
    assert cfg.data.data_dir == "data/demo" and cfg.log.out_dir == os.path.join("runs", "tiny")


def test_paper_configs_cover_every_encoding_with_and_without_ssmax_at_both_lengths():
    seen = set()
    for path in PAPER_CONFIGS:
        cfg = load_config(path)
        assert cfg.train.tokens_per_step == 589_824 and cfg.train.max_steps == 20_000, path
        assert cfg.train.optimizer == "radam" and cfg.model.block_size in (512, 1024), path
        for world_size in (1, 2, 4, 8):
            check(cfg, world_size)  # every paper run fits one GPU and one 8-GPU node
        seen.add((cfg.model.pe, cfg.model.ssmax, cfg.model.block_size, cfg.model.n_layer))
        # the file name says what the file trains
        name = os.path.basename(path)
        assert name.startswith(cfg.model.pe + ("_ssmax_" if cfg.model.ssmax else "_") + str(cfg.model.block_size)), path
    for pe in ("nope", "sinusoidal", "rope", "alibi", "bam"):
        for ssmax in (False, True):
            for context in (512, 1024):
                assert (pe, ssmax, context, 12) in seen, (pe, ssmax, context)
    # the paper's other model sizes, for its headline variant
    assert {(6, 512), (8, 768), (15, 1152), (18, 1536), (24, 2048)} <= {
        (load_config(p).model.n_layer, load_config(p).model.n_embd) for p in PAPER_CONFIGS}


def test_paper_configs_are_short():
    for path in PAPER_CONFIGS:
        with open(path) as f:
            settings = [line for line in f if line.strip() and not line.lstrip().startswith(("#", "["))]
        assert len(settings) <= 4, path


def test_base_file_is_applied_first_and_the_child_wins(tmp_path):
    (tmp_path / "base.toml").write_text('[model]\nn_layer = 3\npe = "rope"\n[train]\nlr = 0.01\n')
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[model]\npe = "bam"\n')
    cfg = load_config(str(tmp_path / "child.toml"), ["--train.lr=0.02"])
    assert (cfg.model.n_layer, cfg.model.pe, cfg.train.lr) == (3, "bam", 0.02)
    assert cfg.log.out_dir == os.path.join("runs", "child")  # named after the file given, not its base


def test_base_files_that_include_each_other_are_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="include each other"):
        load_config(str(tmp_path / "a.toml"))
    (tmp_path / "c.toml").write_text('base = "missing.toml"\n')
    with pytest.raises(ConfigError, match="missing.toml does not exist"):
        load_config(str(tmp_path / "c.toml"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "**",
                                                                 "*.toml"), recursive=True)))
def test_every_shipped_config_loads(path):
    load_config(path)
