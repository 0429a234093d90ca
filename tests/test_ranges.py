"""Every number a user can give, refused in one line when it is not finite or out of range, before anything is
created (issue 24, class 1). Driven from the declarations, so a new option is covered without a new test:
every numeric config field must have a range (model.model_ranges(), config.RANGES), every numeric flag of every
command must be a ranges.number, and each is then fed inf, nan and a value just outside its range."""

import argparse
import dataclasses
import math
import sys
import typing

import pytest
import torch

import eval as eval_package
import export_hf
import model
import prepare_fineweb
import sample
import train
from bam import checkpoint, config, ranges
from bam.config import ConfigError, load_config
from eval import report

TINY = "configs/tiny.toml"


def outside(spec, kind):
    """A value that breaks the first bound of `spec` (">= 1" -> 0, "> 0" -> 0, "<= 18" -> 19)."""
    op, limit = ranges.bounds(spec)[0]
    step = 1 if kind is int else 0.5
    value = {">=": limit - step, ">": limit, "<=": limit + step, "<": limit}[
        next(k for k, v in ranges.OPERATORS.items() if v is op)]
    return int(value) if kind is int else value


def numeric_fields(cls):
    hints = typing.get_type_hints(cls)
    return {f.name: config.number_kind(hints[f.name]) for f in dataclasses.fields(cls)
            if config.number_kind(hints[f.name])}


def config_cases():
    for section, cls in config.SECTIONS.items():
        table = model.model_ranges() if section == "model" else config.RANGES.get(section, {})
        for key, kind in numeric_fields(cls).items():
            yield section, key, kind, table.get(key)


CONFIG_CASES = list(config_cases())


def test_every_numeric_setting_declares_its_range():
    missing = [f"{s}.{k}" for s, k, _, spec in CONFIG_CASES if spec is None]
    assert not missing, f"add a range for {missing} (an encoding's RANGES, model.CORE_RANGES or config.RANGES)"
    assert len(CONFIG_CASES) >= 39


@pytest.mark.parametrize("section,key,kind,spec", CONFIG_CASES, ids=[f"{c[0]}.{c[1]}" for c in CONFIG_CASES])
def test_every_numeric_setting_refuses_inf_nan_and_out_of_range_in_one_line(section, key, kind, spec):
    list_field = key == "betas"
    bad = ["inf", "-inf", "nan"] + ([repr(outside(spec, kind))] if spec else [])  # "": any finite number
    if kind is int:
        bad.append("2.5")
    for value in bad:
        text = f"[0.9, {value}]" if list_field else value
        with pytest.raises(ConfigError) as info:
            load_config(TINY, [f"--{section}.{key}={text}"])
        message = str(info.value)
        assert "\n" not in message and key in message, message
        if spec and value == repr(outside(spec, kind)):
            assert spec in message  # what is allowed, in the words of the declaration


def test_the_model_checks_its_ranges_when_built_directly_too():
    """Checkpoints, evaluator overrides and HF exports build ModelConfig without bam/config.py."""
    with pytest.raises(ValueError, match=r"^model config: rope_theta = 0.0: allowed: a finite number >= 2$"):
        model.ModelConfig(rope_theta=0.0)
    with pytest.raises(ValueError, match="mlp_hidden = -64"):
        model.ModelConfig(mlp_hidden=-64)


def test_the_two_copies_of_the_range_check_agree():
    """model.check_ranges (model.py stays free of the repository's modules) and ranges.check."""
    @dataclasses.dataclass
    class Probe:
        x: float = 0.0
        n: int = 0

    for spec in (">= 1", "> 0", ">= 0, <= 1", "> 0, < 1", ">= -30, <= 30", ""):
        for kind, name in ((float, "x"), (int, "n")):
            for value in (-31, -1, 0, 0.5, 1, 2, 31, math.inf, math.nan):
                if kind is int and not (isinstance(value, int)):
                    continue
                probe = Probe(**{name: value})
                errors = []
                model.check_ranges(probe, {name: spec}, errors.append)
                assert bool(errors) == bool(ranges.problem(value, spec, kind)), (spec, value)


def paper_settings():
    """The settings docs/paper.md §2 and §4 give (and the official code's BAM initialisations), as overrides."""
    yield "the paper's training", ["--train.lr=1e-3", "--train.warmup_steps=0", "--train.min_lr_frac=0.1",
                                   "--train.betas=[0.9, 0.95]", "--train.weight_decay=0.1", "--train.grad_clip=1.0",
                                   "--train.optimizer=radam", "--model.norm_eps=1e-5"]
    yield "RoPE's theta", ["--model.pe=rope", "--model.rope_theta=500000"]
    yield "sinusoidal's base", ["--model.pe=sinusoidal", "--model.sinusoidal_base=10000"]
    for init in model.BAMPrior.INITS:
        yield f"bam_init = {init}", ["--model.pe=bam", "--model.ssmax=true", f"--model.bam_init={init}"]
    for shape in (-2, -1, -0.6, -0.5, 0, 0.5, 1, 2, 3):  # retrieval heads, NoPE, ALiBi and sharper
        yield f"b = {shape}", ["--model.pe=bam", "--model.bam_init=constant", f"--model.bam_init_shape={shape}",
                               "--model.bam_init_log_scale=-2"]


@pytest.mark.parametrize("what,overrides", list(paper_settings()), ids=[w for w, _ in paper_settings()])
def test_the_papers_settings_and_the_official_codes_are_accepted(what, overrides):
    """A range refuses nonsense, never a value the method admits (issue 34): b <= 0 is the paper's retrieval
    head, b = 0 NoPE, and a constant start at b = 0 with a chosen scale is a natural ablation."""
    cfg = load_config(TINY, overrides)
    shapes = [float(o.split("=")[1]) for o in overrides if o.startswith("--model.bam_init_shape=")]
    for shape in shapes:
        prior = model.Transformer(dataclasses.replace(cfg.model, n_layer=1)).priors[0]
        assert prior.tensors()[0].eq(shape).all()


# -- every command line -------------------------------------------------------------------------------

class Captured(Exception):
    pass


def command_mains():
    mains = {"train.py": train.main, "prepare_fineweb.py": prepare_fineweb.main, "sample.py": sample.main,
             "export_hf.py": export_hf.main, "checkpoint.py": checkpoint.main, "eval.report": report.main}
    for name in eval_package.EVALUATORS:
        module = __import__(name, fromlist=["main"])
        mains[name] = module.main
    for name in ("bench.attention", "bench.data_bench", "bench.gpu_check.cli", "bench.gpu_check.prepare",
                 "bench.train_bench"):
        main = __import__(name, fromlist=["main"]).main
        # the benchmarks read sys.argv themselves (all but gpu_check's); the parser is caught before they run
        mains[name] = main if name.startswith("bench.gpu_check") else (lambda argv, main=main: main())
    return mains


def parser_of(main, monkeypatch):
    """The parser a command builds, caught as it starts parsing."""
    def capture(self, args=None, namespace=None):
        raise Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)  # cli.Parser's and the benchmarks'
        m.setattr(sys, "argv", ["x"])
        with pytest.raises(Captured) as info:
            main(["x"])
    return info.value.args[0]


COMMANDS = command_mains()


def numeric_actions(parser):
    return [a for a in parser._actions if a.option_strings and (a.type in (int, float) or isinstance(a.type, ranges.number))]


def minimal_argv(parser):
    """Positionals and required options with values that parse (choices[0] or 'x')."""
    argv = []
    for action in parser._actions:
        if not action.option_strings and action.dest != "help":
            argv.append("x")
        elif action.required:
            argv += [action.option_strings[0], (action.choices and list(action.choices)[0]) or "x"]
    return argv


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_numeric_flag_is_a_checked_number(command, monkeypatch):
    parser = parser_of(COMMANDS[command], monkeypatch)
    plain = [a.option_strings[0] for a in numeric_actions(parser) if a.type in (int, float)]
    assert not plain, f"{command}: declare {plain} with ranges.number(kind, range)"


def flag_cases():
    """(command, flag) for every numeric flag of every command, read from the parsers themselves."""
    cases = []
    mp = pytest.MonkeyPatch()
    try:
        for command, main in COMMANDS.items():
            for action in numeric_actions(parser_of(main, mp)):
                cases.append((command, action.option_strings[0]))
    finally:
        mp.undo()
    return cases


FLAG_CASES = flag_cases()


def test_the_commands_have_numeric_flags_to_check():
    assert len(FLAG_CASES) >= 30
    assert ("sample.py", "--temperature") in FLAG_CASES and ("eval.passkey", "--digits") in FLAG_CASES


@pytest.mark.parametrize("command,flag", FLAG_CASES, ids=[f"{c}{f}" for c, f in FLAG_CASES])
def test_every_numeric_flag_refuses_inf_nan_and_out_of_range_in_one_line(command, flag, monkeypatch, capsys):
    parser = parser_of(COMMANDS[command], monkeypatch)
    action = next(a for a in parser._actions if flag in a.option_strings)
    kind, spec = action.type.kind, action.type.spec
    bad = ["inf", "nan", "-inf", "1e400"] + ([repr(outside(spec, kind))] if spec else []) + (["2.5"] if kind is int else [])
    for value in bad:
        with pytest.raises(SystemExit) as info:
            parser.parse_known_args(minimal_argv(parser) + [f"{flag}={value}"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and flag in err and repr(value) in err, err
        assert ranges.allowed(kind, spec) in err


# -- every accepted value works: a tiny model at each range's extremes runs a forward (issue 59) --------------

# Sizes grow memory, not risk: their extreme is the lower bound alone (a width of 10^9 is for the dry run to
# plan). Every other number is also tried far out where its range is open above or below.
SIZES = {"vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "attn_head_dim", "fire_mlp_width",
         "t5_num_buckets"}
FAR = 1e30
# What a field needs beside it to take effect: RoPE's scalings read their own settings only when chosen.
NEEDS = {"rope_factor": [{"rope_scaling": s} for s in model.RoPE.SCALINGS[1:]],
         "rope_original_context": [{"rope_scaling": "yarn", "rope_factor": 4.0},
                                   {"rope_scaling": "dynamic_ntk", "rope_factor": 4.0}],
         "yarn_beta_fast": [{"rope_scaling": "yarn", "rope_factor": 4.0}],
         "yarn_beta_slow": [{"rope_scaling": "yarn", "rope_factor": 4.0}],
         "llama3_low_freq_factor": [{"rope_scaling": "llama3", "rope_factor": 4.0}],
         "llama3_high_freq_factor": [{"rope_scaling": "llama3", "rope_factor": 4.0}],
         "bam_init_shape": [{"bam_init": "constant"}], "bam_init_log_scale": [{"bam_init": "constant"}]}


def extremes(spec, integer):
    """The values at the ends of a range: a closed bound itself, just inside an open one, far out where it is
    unbounded (ranges.bounds' notation)."""
    low = high = None
    for op, limit in ranges.bounds(spec) if spec else ():
        name = next(k for k, v in ranges.OPERATORS.items() if v is op)
        step = 1 if integer else max(abs(limit) * 1e-6, 1e-30)
        value = limit if name in (">=", "<=") else (limit + step if name == ">" else limit - step)
        low, high = (value, high) if name.startswith(">") else (low, value)
    values = [low if low is not None else -FAR, high if high is not None else FAR]
    return [int(v) if integer else float(v) for v in values if not integer or abs(v) < 2**62]


def owner(field):
    """The encoding whose options hold `field`, or None for the model's own."""
    return next((name for name, encoding in model.ENCODINGS.items() if field in encoding.RANGES), None)


def extreme_cases():
    hints = typing.get_type_hints(model.ModelConfig)
    for field, spec in model.model_ranges().items():
        integer = hints[field] is int
        values = extremes(spec, integer)
        if field in SIZES:
            values = values[:1]
        pe = owner(field)
        for value in values:
            for extra in NEEDS.get(field, [{}]):
                for encoding in ([pe] if pe else ["bam", "rope", "fox"]):
                    yield field, value, encoding, extra


@pytest.mark.parametrize("field,value,pe,extra", list(extreme_cases()),
                         ids=[f"{f}={v:g}-{p}-{'-'.join(map(str, e.values()))}" for f, v, p, e in extreme_cases()])
def test_a_model_at_each_ranges_extreme_is_refused_or_runs(field, value, pe, extra):
    """No accepted value fails later (issue 59, point 3): a value at the end of its range either is refused when
    the config is made, in one line, or makes a model whose forward gives finite logits on every dense path, SSMax
    and documents included (the paths a CPU run takes; flex's masks read the same windows)."""
    settings = dict(vocab_size=31, n_layer=2, n_head=2, n_embd=16, block_size=16, pe=pe, ssmax=True, **extra)
    settings[field] = value
    if field == "n_kv_head" and value:
        settings["n_head"] = value
    try:
        cfg = model.ModelConfig(**settings)
    except ValueError as e:
        assert "\n" not in str(e) and str(e).startswith("model config: "), e
        return
    torch.manual_seed(0)
    net = model.Transformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    for impl in ("eager", "sdpa"):
        net.config.attn_impl = impl
        with torch.no_grad():
            logits, _ = net(idx, doc_ids=doc_ids)
        assert torch.isfinite(logits).all(), f"{field} = {value} ({pe}, {extra}) gives non-finite logits on {impl}"
