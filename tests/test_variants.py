"""eval.variants: which runs are seeds of one variant, and what each variant is called."""

from eval.variants import experiment, group, names, variant_key

DEFAULTS = {"model.bam_init": "alibi", "train.prior_lr": 0.0, "train.lr": 1e-3, "model.ssmax": False}


def config(seed=1, out="runs/x", **changes):
    c = {"model": {"pe": "bam", "ssmax": True, "bam_init": "alibi", "attn_impl": "auto"},
         "data": {"data_dir": "data/repro5", "batch_size": 32},
         "train": {"seed": seed, "lr": 3e-3, "prior_lr": 0.0, "max_steps": 2000, "compile": False},
         "log": {"out_dir": out, "run_name": ""}}
    for key, value in changes.items():
        section, name = key.split("__")
        c[section][name] = value
    return c


def test_seeds_and_output_folders_do_not_make_a_variant_but_a_setting_or_an_override_does():
    runs = [("a", config(1, "runs/bam_ssmax_seed1"), {}),
            ("b", config(2, "runs/bam_ssmax_seed2", data__data_dir="/elsewhere/repro5"), {}),
            ("c", config(1, "runs/u", model__bam_init="uniform"), {}),
            ("d", config(3, "runs/d", model__attn_impl="sdpa", train__compile=True), {}),
            ("e", config(1, "runs/bam_ssmax_seed1"), {"attn_window": 128}),
            ("f", config(1, "runs/f", train__max_steps=4000), {})]
    variants = group(runs, lambda r: r[1], lambda r: r[2])
    assert [[r[0] for r in v] for v in variants] == [["a", "b", "d"], ["c"], ["e"], ["f"]]
    assert variant_key(config(1), {}) == variant_key(config(9, "other"), {})
    assert "train.seed" not in experiment(config()) and "log.out_dir" not in experiment(config())
    assert experiment({"pe": "rope"}) == {"model.pe": "rope"}  # a results file's model config alone


def test_a_variant_is_named_by_what_sets_it_apart_from_its_peers():
    configs = [config(), config(model__bam_init="uniform"), config(train__prior_lr=3e-2), config(),
               {"model": {"pe": "rope"}, "train": {"lr": 3e-3}}]
    labels = ["bam + ssmax", "bam + ssmax", "bam + ssmax", "bam + ssmax (W=128)", "rope"]
    assert names(labels, configs, DEFAULTS) == ["bam + ssmax", "bam + ssmax, init uniform",
                                                 "bam + ssmax, prior lr x10", "bam + ssmax (W=128)", "rope"]
    # Two variants with one label and no default among their values are both named
    both = names(["bam", "bam"], [config(model__bam_init="uniform"), config(model__bam_init="sampled")], DEFAULTS)
    assert both == ["bam, init uniform", "bam, init sampled"]
    # the training budget in steps; without a default to leave out, each variant says its value
    assert names(["bam", "bam"], [config(), config(train__max_steps=10000)], DEFAULTS) == ["bam, 2,000 steps",
                                                                                        "bam, 10,000 steps"]
    assert names(["bam", "bam"], [config(), config(train__max_steps=4000)], {**DEFAULTS, "train.max_steps": 2000}) \
        == ["bam", "bam, 4,000 steps"]
    # any other setting by its own name
    assert names(["bam", "bam"], [config(), config(train__weight_decay=0.0)], DEFAULTS) == ["bam",
                                                                                         "bam, weight decay 0"]


def test_foxs_gate_init_bias_is_named_after_the_fox_label():
    """configs/repro/fox_ssmax_open.toml beside fox_ssmax.toml, as eval.report reads them (every setting, the
    ones newer than a kept run's file at their defaults)."""
    from bam.config import load_config, to_dict
    from eval.variants import flatten

    configs = [to_dict(load_config(f"configs/repro/{name}.toml")) for name in ("fox_ssmax", "fox_ssmax_open")]
    defaults = flatten(to_dict(load_config()))
    assert names(["fox + ssmax"] * 2, configs, defaults) == ["fox + ssmax", "fox + ssmax, gate init bias 5"]


def repro(name, *overrides):
    """configs/repro/NAME.toml as eval.report reads it: every setting, flattened."""
    from bam.config import load_config, to_dict

    return to_dict(load_config(f"configs/repro/{name}.toml", list(overrides)))


def schema_defaults():
    from bam.config import load_config, to_dict
    from eval.variants import flatten

    return flatten(to_dict(load_config()))


def test_a_variant_alone_is_still_named_by_its_encodings_settings_away_from_the_defaults():
    # the quickstart's report (RUNS="rope bam_ssmax_uniform"): nothing else in it is BAM, yet its BAM starts flat,
    # not at the paper's ALiBi init, and the name says so
    assert names(["rope", "bam + ssmax"], [repro("rope"), repro("bam_ssmax_uniform")], schema_defaults()) \
        == ["rope", "bam + ssmax, init uniform"]
    assert names(["bam + ssmax"], [repro("bam_ssmax")], schema_defaults()) == ["bam + ssmax"]
    assert names(["fox + ssmax"], [repro("fox_ssmax_open")], schema_defaults()) == ["fox + ssmax, gate init bias 5"]
    assert names(["bam + ssmax"], [repro("bam_ssmax_prior_lr")], schema_defaults()) == ["bam + ssmax, prior lr x10"]
    # a field of the run's own encoding drops the encoding's name, which the label gives; a trained window is named
    alone = [repro("rope", "--model.rope_theta=10000"), repro("nope", "--model.attn_window=64"),
             repro("bam", "--model.bam_train_loc=true")]
    assert names(["rope", "nope", "bam"], alone, schema_defaults()) == ["rope, theta 10000", "nope, attn window 64",
                                                                         "bam, train loc true"]


def test_settings_of_another_encoding_and_derived_ones_stay_out_of_a_name():
    # a BAM field on a NoPE run changes nothing it computes; the YaRN fine-tune's original context (the
    # pretraining context its "x4" counts from) and its scaling are in the label or derived, not named again
    configs = [repro("nope", "--model.bam_init=uniform"), repro("rope_yarn_ft")]
    assert names(["nope", "rope + YaRN x4"], configs, schema_defaults()) == ["nope", "rope + YaRN x4"]
    yarn = repro("rope_yarn_ft", "--model.yarn_beta_fast=16")  # a setting of the scaling it uses: named
    assert names(["rope + YaRN x4"], [yarn], schema_defaults()) == ["rope + YaRN x4, yarn beta fast 16"]


def test_a_run_that_changed_its_encoding_after_pretraining_is_named_drope_and_compared_with_its_own_kind():
    """train.init_from with train.init_change_pe (DroPE's recipe): "DroPE", its recalibration schedule (train.*)
    part of that name and its peers the runs recalibrated alike, so a NoPE run from scratch at another budget keeps
    the plain name of its budget, and a plain fine-tune stays "fine-tuned"."""
    drope = dict(train__init_from="runs/rope_seed1", train__init_change_pe=True, train__max_steps=200,
                 train__lr=1e-3, train__weight_decay=0.0)
    configs = [config(model__pe="nope", model__ssmax=False, **drope),
               config(model__pe="nope", model__ssmax=False, train__max_steps=2200),
               config(model__pe="nope", model__ssmax=False),
               config(**drope), config(train__prior_lr=1e-2, **drope),
               config(model__pe="rope", model__ssmax=False, train__init_from="runs/rope_seed1")]
    labels = ["nope", "nope", "nope", "bam + ssmax", "bam + ssmax", "rope"]
    assert names(labels, configs, DEFAULTS) == ["nope, DroPE", "nope, 2,200 steps", "nope, 2,000 steps",
                                                 "bam + ssmax, DroPE", "bam + ssmax, prior lr x10, DroPE",
                                                 "rope, fine-tuned"]
