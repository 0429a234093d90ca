"""
Runs as variants: the runs whose resolved configs differ only in the seed (and in where they were written)
are one variant, the experiment that eval.report aggregates over seeds. Here a variant is found
(`assign_variants`), named (`names`), and its runs gathered (`by_variant`) and sorted into the encoding
families of the report's small multiples (`by_family`).

Evaluator overrides (`--window`, `--rope_scaling yarn --rope_factor auto`, ...) make variants of their own:
"rope + YaRN auto" evaluated on four RoPE seeds is a variant of four seeds, next to plain "rope".

A variant is named by its encoding's label (eval's `overrides_label`: "bam + ssmax", "rope + YaRN auto"),
then by every setting of its positional encoding that is not at its default (`positional_settings`), whatever
else the report holds, so that a name alone says what was run: "bam + ssmax" is the paper's ALiBi init,
"bam + ssmax, init uniform" the flat start even in a report of one run, "fox + ssmax, gate init bias 5".
Then come the other settings in which it differs from the variants that share its label, again leaving out
a setting at its default ("bam + ssmax, 10,000 steps" beside "bam + ssmax, 2,000 steps"): the model's size
or the schedule, which a report's variants usually share, would only clutter every name. A run trained on
from another's weights (train.init_from) is "fine-tuned": "rope + YaRN x4, fine-tuned". Folder names never
enter a name.
"""

import json

from bam.config import load_config, to_dict
from eval.options import overrides_label
from model import ENCODINGS

# Settings that do not change what a run learns: the seed (what a variant averages over), where its files
# go and how it logs, and implementation choices that are proven equal (attention paths, compilation) or
# only decide how often something is saved or measured.
# train.init_from is in the list as the seed is: fine-tunes of two seeds' weights are two seeds of one
# variant, which its name calls "fine-tuned".
# The spike guard (train.spike_*) only decides whether a run stops: a run that trained to the end is the same run
# under any of its settings, and they may change on resume.
NOT_THE_EXPERIMENT = ("train.seed", "train.init_from", "data.data_dir", "log.", "model.attn_impl", "model.flex_prior",
                      "train.compile", "train.ckpt_every", "train.keep_last", "train.val_every", "train.val_tokens",
                      "train.spike_")


def flatten(config):
    """{"model": {"pe": "bam"}, ...} -> {"model.pe": "bam", ...}; a model config alone (no sections) is
    read as the model section."""
    if config and not any(isinstance(v, dict) for v in config.values()):
        config = {"model": config}
    return {f"{section}.{key}": value for section, table in (config or {}).items() if isinstance(table, dict)
            for key, value in table.items()}


def experiment(config):
    """The flattened settings that define the experiment (NOT_THE_EXPERIMENT left out)."""
    return {k: v for k, v in flatten(config).items() if not k.startswith(NOT_THE_EXPERIMENT)}


def variant_key(config, overrides):
    """Equal for two runs exactly when they are seeds of one variant."""
    return json.dumps([experiment(config), overrides or {}], sort_keys=True, default=str)


def group(items, config_of, overrides_of):
    """`items` (runs) grouped into variants, in the order each variant first appears."""
    variants = {}
    for item in items:
        variants.setdefault(variant_key(config_of(item), overrides_of(item)), []).append(item)
    return list(variants.values())


# Positional settings a name leaves out: the RoPE scaling and its factor, and the layer pattern, are in the label
# already ("rope + YaRN x4", "nope, layer pattern rope@64*2 nope@full"), and rope_original_context is derived (0 means block_size; a fine-tune sets it to the context it was
# pretrained at, which the "x4" is counted from): it says where the model came from, not what it is.
IN_THE_LABEL_OR_DERIVED = ("model.rope_scaling", "model.rope_factor", "model.rope_original_context",
                           "model.layer_pattern")


def positional_settings(settings):
    """The keys of flattened `settings` that configure the run's positional encoding: the model fields named
    after it (bam_* for bam, fox_* for fox, rope_* for rope, as model.ENCODINGS names them) or after the RoPE
    scaling it uses (yarn_*), a trained sliding window (RoPE-local is rope with a window), the layer pattern
    (each layer's encoding, window and SSMax), and train.prior_lr, the learning rate of the prior's (and
    SSMax's) parameters."""
    owners = (settings.get("model.pe"), settings.get("model.rope_scaling"))
    prefixes = tuple(f"model.{owner}_" for owner in owners if owner and owner != "none")
    return {k for k in settings if k not in IN_THE_LABEL_OR_DERIVED
            and (k.startswith(prefixes) or k in ("model.attn_window", "model.layer_pattern", "train.prior_lr"))}


def _number(value):
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_setting(key, value, settings):
    """How a variant's name says one of its settings, e.g. "init uniform", "prior lr x10"; a field of the run's
    own encoding without the encoding's name, which the label already gives ("bam + ssmax, init uniform")."""
    name = key.split(".", 1)[1]
    own = f"{settings.get('model.pe')}_"
    if key.startswith("model.") and name.startswith(own):
        name = name[len(own):]
    if key == "train.max_steps":  # the training budget: "10,000 steps"
        return f"{value:,} steps"
    if key == "train.prior_lr" and settings.get("train.lr"):  # unset: the prior trains at the base rate, x1
        return f"prior lr x{_number(round((value or settings['train.lr']) / settings['train.lr'], 3))}"
    return f"{name.replace('_', ' ')} {_number(value)}"


def recalibrated(config):
    """Trained on from another run's weights with its positional encoding changed (train.init_from with
    train.init_change_pe): DroPE's recipe, RoPE dropped after pretraining (docs/training.md)."""
    settings = flatten(config)
    return bool(settings.get("train.init_from") and settings.get("train.init_change_pe"))


def names(labels, configs, defaults):
    """A name per variant: its label, then its positional settings and the settings that differ among the
    variants sharing that label, except those at their default value (`defaults`: flattened settings of the
    schema's defaults). A run trained on from another's weights is "fine-tuned", or "DroPE" where its encoding
    changed: such a run's peers are the runs recalibrated alike, and the recalibration's schedule (train.*) is
    part of that name, not listed."""
    settings = [experiment(c) for c in configs]
    kinds = [recalibrated(c) for c in configs]
    out = []
    for label, mine, config, kind in zip(labels, settings, configs, kinds):
        peers = [s for l, s, k in zip(labels, settings, kinds) if l == label and k == kind]
        differing = {k for s in peers for k in s if any(p.get(k) != s.get(k) for p in peers)}
        named = sorted(differing | positional_settings(mine))
        if kind:
            named = [k for k in named if not k.startswith("train.") or k == "train.prior_lr"]
        parts = [describe_setting(k, mine[k], mine) for k in named if k in mine and mine[k] != defaults.get(k)]
        if flatten(config).get("train.init_from"):  # trained on from another run's weights
            parts.append("DroPE" if kind else "fine-tuned")
        out.append(", ".join([label] + parts))
    return out


def assign_variants(runs):
    """Name every run's variant and seed (eval.runs.Run): the runs that differ only in seed and folder share
    one variant."""
    def config_of(run):
        return run.config or run.model_config

    groups = group(runs, config_of, lambda r: r.overrides)
    labels = [overrides_label(g[0].model_config, g[0].overrides) for g in groups]
    defaults = flatten(to_dict(load_config()))  # what a config file that sets nothing gets
    for members, name in zip(groups, names(labels, [config_of(g[0]) for g in groups], defaults)):
        for run in members:
            run.variant = name
            run.seed = flatten(config_of(run)).get("train.seed")


def by_variant(runs):
    """{variant name: [its runs, one per seed]}, in the order the variants first appear."""
    variants = {}
    for run in runs:
        variants.setdefault(run.variant or run.name, []).append(run)
    return variants


def by_family(variants):
    """{family: [variant names]} of {variant: [its runs]}, by the encoding's family (model.ENCODINGS), for
    small multiples: RoPE and its extensions in one panel, additive priors in another, ..., the families in
    the registry's order."""
    families = {}
    for variant, members in variants.items():
        pe = members[0].model_config.get("pe")
        families.setdefault(getattr(ENCODINGS.get(pe), "family", "other"), []).append(variant)
    order = list(dict.fromkeys(e.family for e in ENCODINGS.values()))  # baselines, RoPE, ..., as the registry
    return dict(sorted(families.items(), key=lambda f: order.index(f[0]) if f[0] in order else len(order)))
