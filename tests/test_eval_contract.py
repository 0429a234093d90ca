"""The evaluators' contract: a new evaluator is one file and one line of eval.EVALUATORS, and eval.report
finds its results, section and plots; what importing the evaluators loads; model overrides checked once,
by ModelConfig's rules, without touching the caller's model."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import eval as eval_package
from bam.checkpoint import save_model
from bam.cli import run_cli
from eval import EvalError, passkey, report
from eval.loading import load_for_eval
from eval.options import EvalOptions
from tiny_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A whole evaluator, written against the public contract only: the mean absolute weight of every parameter
# tensor of the model, its own option, table, plot, report section and summary plot.
TOY_EVALUATOR = '''
"""Toy: the mean absolute weight of the model's parameters."""

from eval.contract import Evaluator
from eval.loading import load_for_eval
from eval.options import EvalOptions, add_model_arguments, add_output_arguments
from eval.results import Output, new_results
from eval.tables import table


def evaluate_toy(source, *, options=None, scale=1.0):
    options = options or EvalOptions()
    evaluated = load_for_eval(source, options)
    output = Output.of(EVALUATOR, source, options, "toy")
    weights = [float(p.detach().abs().mean()) * scale for p in evaluated.model.parameters()]
    results = new_results("toy", evaluated.info, evaluated.settings(scale=scale),
                          results=[{"mean_abs_weight": sum(weights) / len(weights)}])
    results["complete"] = True
    return output.finish(results)


def add_arguments(ap):
    ap.add_argument("source")
    ap.add_argument("--scale", type=float, default=1.0)
    add_model_arguments(ap)
    add_output_arguments(ap)


def run(args, options):
    evaluate_toy(args.source, options=options, scale=args.scale)


def format_table(results):
    return f"toy: {results['results'][0]['mean_abs_weight']:.6f}"


def plot(results, path):
    from eval.plotting import plt, save_figure

    fig, ax = plt.subplots()
    ax.bar([0], [results["results"][0]["mean_abs_weight"]])
    save_figure(fig, path)


def section(runs, report_options):
    rows = [[r.name, f"{r.get('toy')['results'][0]['mean_abs_weight']:.6f}"] for r in runs if r.get("toy")]
    return ["Mean absolute weight (scaled by --toy_scale_note: " + str(report_options.get("toy_note")) + ")", ""] + \\
        table(["run", "weight"], rows)


def summary(runs, path):
    plot(next(r.get("toy") for r in runs if r.get("toy")), path)
    return True


def report_arguments(ap):
    ap.add_argument("--toy_note", default="none")


EVALUATOR = Evaluator(name="toy", title="Toy weights", description=__doc__, add_arguments=add_arguments, run=run,
                      table=format_table, plot=plot, section=section, summary_plot=summary,
                      run_plots=(("toy weights", ""),), report_arguments=report_arguments)
main = EVALUATOR.main
'''


def test_a_new_evaluator_is_one_file_and_one_registry_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "toy_evaluator.py").write_text(textwrap.dedent(TOY_EVALUATOR))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(eval_package, "EVALUATORS", [*eval_package.EVALUATORS, "toy_evaluator"])  # the one line
    import toy_evaluator

    run = tmp_path / "run"
    model = tiny_model(vocab_size=50257, block_size=64)  # GPT-2's ids: the passkey prompts below
    save_model(model, str(run / "checkpoints" / "step_00000001.pt"))
    assert toy_evaluator.main([str(run), "--scale", "2", "--window", "8"]) == 0
    assert "toy: " in capsys.readouterr().out
    saved = json.loads((run / "eval" / "toy_window8.json").read_text())  # the overrides name the file
    assert saved["schema"] == "toy" and saved["settings"]["model_overrides"] == {"attn_window": 8}
    assert (run / "eval" / "toy_window8.png").stat().st_size > 1000
    assert passkey.main([str(run), "--lengths", "128", "--samples", "2", "--no_progress"]) == 0
    capsys.readouterr()

    out = tmp_path / "report" / "report.md"
    assert report.main([str(run), "--out", str(out), "--toy_note", "twice"]) == 0
    text = out.read_text()
    toy = text.split("## Toy weights")[1].split("## Plots")[0]
    assert "scaled by --toy_scale_note: twice" in toy and "| run: bam-local (W=8) |" in toy
    assert text.index("## Passkey retrieval") < text.index("## Toy weights") < text.index("## Plots")
    assert "![](report_toy.png)" in text and (tmp_path / "report" / "report_toy.png").exists()
    plots = next(line for line in text.splitlines() if line.startswith("| toy weights |"))
    assert "toy_window8.png" in plots


@pytest.mark.slow
def test_importing_sample_or_an_evaluator_loads_no_plotting_library():
    modules = ", ".join(repr(m) for m in eval_package.EVALUATORS)
    check = ("import sys, importlib, sample\n"
             "assert 'matplotlib' not in sys.modules, 'sample'\n"
             f"for name in [{modules}, 'eval.report']:\n"
             "    importlib.import_module(name)\n"
             "    loaded = [m for m in sys.modules if m.startswith(('matplotlib', 'lm_eval'))]\n"
             "    assert not loaded, (name, loaded[:3])\n")
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_overrides_are_checked_by_modelconfig_and_the_callers_model_is_left_alone():
    model = tiny_model(pe="rope", block_size=64).eval()
    trained = dict(vars(model.config))
    evaluated = load_for_eval(model, EvalOptions(model_overrides={"attn_window": 16, "rope_scaling": "yarn",
                                                                  "rope_factor": "auto"}))
    assert vars(model.config) == trained  # the caller's model keeps its config
    at_256, per_length = evaluated.at_length(256)
    assert per_length == {"rope_factor": 4.0} and at_256.config.rope_factor == 4.0 and at_256.config.attn_window == 16
    assert evaluated.at_length(32)[0].config.rope_factor == 1.0  # shorter than the context: unscaled
    assert at_256.blocks[0].attn.cfg is at_256.config  # every module reads the evaluated config
    assert at_256.tok_emb.weight is model.tok_emb.weight  # ... and shares the trained weights
    assert vars(model.config) == trained and evaluated.info["config"]["rope_factor"] == 1.0
    # A value ModelConfig refuses is refused with ModelConfig's own words (it used to accept 0 < factor < 1)
    for overrides, message in (({"rope_scaling": "yarn", "rope_factor": 0.5}, "rope_factor = 0.5: allowed: a finite number >= 1"),
                               ({"attn_window": -1}, "attn_window = -1: allowed: an integer >= 0"),
                               ({"rope_factor": 2.0}, "has no effect with rope_scaling='none'"),
                               ({"ssmax": True}, "model.ssmax cannot be overridden")):
        with pytest.raises(EvalError, match=message):
            load_for_eval(model, EvalOptions(model_overrides=overrides))


def test_a_bad_override_from_the_command_line_is_one_line(tmp_path, capsys):
    model = tiny_model(pe="rope", vocab_size=50257, block_size=64)  # GPT-2's ids: the evaluators feed them
    save_model(model, str(tmp_path / "run" / "checkpoints" / "step_00000001.pt"))
    with pytest.raises(SystemExit):
        run_cli(passkey.main, [str(tmp_path / "run"), "--rope_scaling", "yarn", "--rope_factor", "0.5"])
    err = capsys.readouterr().err.strip()
    assert err == "error: model config: rope_factor = 0.5: allowed: a finite number >= 1"
