"""eval.report over seeds: runs grouped into variants, cells aggregated over seeds with intervals, --compare,
the small-multiples plot, and images copied next to the report (no broken link)."""

import json
import os
import shutil
import re

import pytest

from bam.cli import run_cli
from bam.config import load_config, to_toml
from eval import report
from eval.results import SCHEMA_VERSION
from eval.runs import load_runs
from eval.variants import assign_variants

pytestmark = pytest.mark.slow  # eval.report end to end on grids of runs

LENGTHS = [128, 256, 512]


def fake_run(root, name, seed, correct, overrides=(), model_overrides=None, legacy=False, samples=20,
             checkpoints=True):
    """A run directory as train.py and eval.passkey leave it: config.toml, checkpoints/, eval/passkey*.json
    with `correct` prompts right (of `samples`) at each of LENGTHS."""
    run = root / name
    run.mkdir(parents=True, exist_ok=True)
    if checkpoints:  # False: a finished run kept without them (configs/repro/grid5.sh's docs/repro/runs5)
        (run / "checkpoints").mkdir(exist_ok=True)
    cfg = load_config(None, ["--model.pe=bam", "--model.ssmax=true", "--model.n_layer=3", "--model.n_embd=96",
                             "--model.n_head=6", "--model.block_size=128", "--train.lr=3e-3",
                             f"--train.seed={seed}", f"--log.out_dir={run}", *overrides])
    text = to_toml(cfg)
    if legacy:  # written before doc_mask moved to [data]: the old key in [train]
        text = text.replace("doc_mask = true\n", "").replace("[train]\n", "[train]\ndoc_mask = true\n")
    (run / "config.toml").write_text(text)
    (run / "eval").mkdir(exist_ok=True)
    suffix = "".join(f"_{k}{v}" for k, v in (model_overrides or {}).items()).replace("attn_window", "window")
    rows = [{"length": n, "correct": c, "samples": samples, "accuracy": c / samples,
             "factor": n / 128, "by_depth": []} for n, c in zip(LENGTHS, correct)]
    results = {"schema": "passkey", "schema_version": SCHEMA_VERSION,
               "model": {"config": {**json.loads(json.dumps(cfg.model.__dict__))}, "name": name,
                         "num_params": 1000, "num_params_non_embedding": 100, "step": 10, "tokens_seen": 100},
               "settings": {"model_overrides": model_overrides or {}, "samples": samples,
                            "depth_mode": "equidistant", "depth_bins": 1, "given_tokens": 0},
               "results": rows, "stopped": None, "complete": True}
    (run / "eval" / f"passkey{suffix}.json").write_text(json.dumps(results))
    (run / "eval" / f"passkey{suffix}.png").write_bytes(b"\x89PNG fake")
    return str(run)


@pytest.fixture
def grid(tmp_path):
    root = tmp_path / "runs"
    return [fake_run(root, "bam_ssmax_seed1", 1, [20, 15, 10]),
            fake_run(root, "bam_ssmax_seed2", 2, [19, 12, 4], legacy=True),
            fake_run(root, "bam_ssmax_seed3", 3, [18, 10, 8]),
            fake_run(root, "bam_ssmax_uniform_seed1", 1, [20, 20, 20], ["--model.bam_init=uniform"]),
            fake_run(root, "bam_ssmax_uniform_seed2", 2, [20, 19, 18], ["--model.bam_init=uniform"]),
            fake_run(root, "bam_ssmax_prior_lr_seed1", 1, [20, 18, 17], ["--train.prior_lr=3e-2"], checkpoints=False),
            fake_run(root, "bam_ssmax_seed1", 1, [20, 20, 19], model_overrides={"attn_window": 64})]


def test_seeds_are_one_variant_named_by_what_sets_it_apart(grid, tmp_path):
    # a seed whose spike guard was turned off (as on resume after a false alarm) is still a seed of the variant
    guard_off = fake_run(tmp_path / "runs", "bam_ssmax_seed4", 4, [20, 20, 20], ["--train.spike_threshold=0"])
    runs = [r for path in dict.fromkeys(grid + [guard_off]) for r in load_runs(path)]
    assign_variants(runs)
    variant = {r.name: r.variant for r in runs}
    assert variant["bam_ssmax_seed1"] == variant["bam_ssmax_seed2"] == variant["bam_ssmax_seed3"] == "bam + ssmax"
    assert variant["bam_ssmax_seed4"] == "bam + ssmax"
    assert variant["bam_ssmax_uniform_seed1"] == variant["bam_ssmax_uniform_seed2"] == "bam + ssmax, init uniform"
    assert variant["bam_ssmax_prior_lr_seed1"] == "bam + ssmax, prior lr x10"
    assert variant["bam_ssmax_seed1: bam-local + ssmax (W=64)"] == "bam-local + ssmax (W=64)"
    assert {r.name: r.seed for r in runs}["bam_ssmax_seed2"] == 2  # the legacy config.toml was read too


def test_a_layer_pattern_names_its_variant(tmp_path):
    """A per-layer pattern (model.layer_pattern) is part of the encoding: two seeds share a variant named by it,
    apart from the model-wide run with the same pe."""
    root = tmp_path / "runs"
    pattern = ["--model.pe=bam", "--model.ssmax=false", "--model.layer_pattern=rope@64*2 bam+ssmax@full"]
    runs = [r for path in (fake_run(root, "global_seed1", 1, [20, 15, 10], pattern),
                           fake_run(root, "global_seed2", 2, [20, 14, 9], pattern),
                           fake_run(root, "bam_ssmax_seed1", 1, [20, 15, 10]))
            for r in load_runs(path)]
    assign_variants(runs)
    variant = {r.name: r.variant for r in runs}
    assert variant["global_seed1"] == variant["global_seed2"] == "bam, layer pattern rope@64*2 bam+ssmax@full"
    assert variant["bam_ssmax_seed1"] == "bam + ssmax"


def test_runs_of_one_name_are_told_apart_by_their_folder_then_their_place(tmp_path):
    # two grids' bam_ssmax_seed1 (docs/repro/runs5 and runs5_10000), then two runs whose folder names match too
    runs = [r for path in (fake_run(tmp_path / "runs5", "bam_ssmax_seed1", 1, [20, 15, 10]),
                           fake_run(tmp_path / "runs5_10000", "bam_ssmax_seed1", 1, [20, 20, 20]),
                           fake_run(tmp_path / "a" / "grid", "nope_seed1", 1, [20, 10, 5]),
                           fake_run(tmp_path / "b" / "grid", "nope_seed1", 1, [20, 12, 6]),
                           fake_run(tmp_path / "runs5", "nope_seed2", 2, [20, 12, 6]))
            for r in load_runs(path)]
    report.distinct_names(runs)
    assert [r.name for r in runs] == ["runs5/bam_ssmax_seed1", "runs5_10000/bam_ssmax_seed1",
                                      "grid/nope_seed1 (3)", "grid/nope_seed1 (4)", "nope_seed2"]


def test_a_fine_tune_is_its_own_variant_whichever_seed_it_started_from(tmp_path):
    # configs/repro/rope_extensions.sh's YaRN fine-tune: trained on at 512 tokens from a RoPE run's weights.
    # Two fine-tunes from two seeds' weights are two seeds of one variant, named by the method they were
    # trained with and "fine-tuned", not by the many settings in which they differ from plain RoPE.
    root = tmp_path / "runs"
    rope = ["--model.pe=rope", "--model.ssmax=false"]
    yarn = [*rope, "--model.block_size=512", "--model.rope_scaling=yarn", "--model.rope_factor=4",
            "--model.rope_original_context=128", "--train.lr=3e-4", "--train.max_steps=400", "--data.batch_size=8"]
    paths = [fake_run(root, "rope_seed1", 1, [20, 10, 0], rope), fake_run(root, "rope_seed2", 2, [19, 9, 0], rope),
             fake_run(root, "ft_seed1", 7, [20, 20, 18], [*yarn, f"--train.init_from={root / 'rope_seed1'}"]),
             fake_run(root, "ft_seed2", 7, [20, 19, 17], [*yarn, f"--train.init_from={root / 'rope_seed2'}"])]
    runs = [r for path in paths for r in load_runs(path)]
    assign_variants(runs)
    assert {r.name: r.variant for r in runs} == {"rope_seed1": "rope", "rope_seed2": "rope",
                                                 "ft_seed1": "rope + YaRN x4, fine-tuned",
                                                 "ft_seed2": "rope + YaRN x4, fine-tuned"}
    # lengths stay multiples of the 128-token pretraining context, the fine-tune's 512 notwithstanding
    out = tmp_path / "report.md"
    assert report.main([*paths, "--out", str(out), "--no_run_plots"]) == 0
    assert "| variant | seeds | 128 (1x) | 256 (2x) | 512 (4x) |" in out.read_text()


def test_report_aggregates_seeds_compares_variants_and_links_only_what_exists(grid, tmp_path):
    out = tmp_path / "docs" / "report.md"
    assert report.main([*dict.fromkeys(grid), "--out", str(out),
                        "--compare", "bam + ssmax, init uniform", "bam + ssmax"]) == 0
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| bam + ssmax | 3 |"))
    # 512 tokens: seeds at 10, 4, 8 of 20 -> 50, 20, 40 %, mean 37 (rounded), with the two-level interval
    assert "37 [50 20 40] (" in row, row
    single = next(line for line in text.splitlines() if line.startswith("| bam + ssmax, prior lr x10 | 1 |"))
    assert "85 (64-95, n=20)" in single  # one seed: its Wilson interval
    assert text.count("Comparisons (`--compare A B`)") == 1  # explained once, above the comparisons
    compare = text[text.index("**bam + ssmax, init uniform** against **bam + ssmax**"):]
    line512 = next(line for line in compare.splitlines() if line.startswith("| 512"))
    assert "| 95 (2) | 37 (3) | +58 (" in line512
    # 2 against 3 seeds: of the C(5, 2) = 10 relabellings only the observed one is as extreme
    assert line512.rstrip(" |").endswith("| 0.1")
    assert "every run" in text and "bam_ssmax_seed2" in text
    # every image the report shows exists, relative to the report: the summary plot and copied run plots
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert any(link.endswith("report_passkey.png") for link in links)
    assert any("report_plots/" in link for link in links)
    for link in links:
        assert (out.parent / link).is_file(), link


def test_an_unknown_variant_to_compare_is_one_line_and_writes_nothing(grid, tmp_path, capsys):
    out = tmp_path / "report.md"
    with pytest.raises(SystemExit):
        run_cli(report.main, [grid[0], "--out", str(out), "--compare", "bam + ssmax", "rope"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --compare 'rope': no such variant") and "'bam + ssmax'" in err
    assert len(err.splitlines()) == 1 and not out.exists()
    assert not os.path.exists(tmp_path / "report_passkey.png")


def fake_priors(run, retrieval, flat=0, scales=True):
    """RUN/eval/priors.json as eval.priors writes it for a BAM model: 6 heads, `retrieval` of them b <= 0,
    `flat` of the others b > 0 at so small a scale that their prior is nearly flat; without the log-scale and
    location columns if not `scales`."""
    shapes = [-0.3] * retrieval + [1.5] * (6 - retrieval)
    log_scales = [0.0] * retrieval + [-14.0] * flat + [0.0] * (6 - retrieval - flat)
    heads = [{"layer": 0, "head": h, "shape": b, "group": "retrieval" if b <= 0 else "local"}
             for h, b in enumerate(shapes)]
    if scales:
        for h, a in zip(heads, log_scales):
            h.update(log_scale=a, loc=0.0)
    results = {"schema": "priors", "schema_version": SCHEMA_VERSION, "model": {"name": os.path.basename(run)},
               "settings": {}, "pe": "bam", "ssmax": True, "shared_across_layers": False, "heads": heads,
               "groups": {"local": 6 - retrieval, "retrieval": retrieval, "aggressive": 0}}
    with open(os.path.join(run, "eval", "priors.json"), "w") as f:
        json.dump(results, f)


def test_report_sets_bam_seeds_that_grew_retrieval_heads_against_their_accuracy(grid, tmp_path):
    fake_priors(grid[0], 0, flat=1)  # bam_ssmax seeds 1-3: 50, 20 and 40 % at 512 tokens
    fake_priors(grid[1], 0, scales=False)
    fake_priors(grid[2], 2)
    with open(os.path.join(grid[3], "eval", "priors.json"), "w") as f:  # a prior without shapes (ALiBi's)
        json.dump({"schema": "priors", "schema_version": SCHEMA_VERSION, "model": {}, "settings": {}, "pe": "alibi",
                   "ssmax": False, "groups": None, "heads": [{"layer": 0, "head": 0, "slope": 0.5}]}, f)
    out = tmp_path / "report.md"
    assert report.main([*dict.fromkeys(grid), "--out", str(out), "--no_run_plots"]) == 0
    text = out.read_text()
    # the heads whose prior puts a key 8x the context (1,024 tokens) back within one logit of its best: the
    # b <= 0 heads and a b > 0 head of tiny scale (e^-14 x 1024^1.5 = 0.03)
    assert "| local | retrieval | aggressive | shape min / median / max | within 1 logit at 8x | passkey |" in text
    assert "| bam_ssmax_seed3 | 4 | 2 | 0 | -0.30 / 1.50 / 1.50 | 2 | 40 at 512 |" in text
    assert "| bam_ssmax_seed1 | 6 | 0 | 0 | 1.50 / 1.50 / 1.50 | 1 | 50 at 512 |" in text
    assert "| bam_ssmax_seed2 | 6 | 0 | 0 | 1.50 / 1.50 / 1.50 | — | 20 at 512 |" in text  # no scales: no count
    assert "| bam_ssmax_uniform_seed1 | — | — | — | alibi: no shapes | — | 100 at 512 |" in text
    assert "mean passkey accuracy (%) at 512 tokens" in text
    assert "| bam + ssmax | 3 | 1 | 40 (40) | 35 (50, 20) |" in text
    assert "| bam + ssmax, init uniform |" not in text.split("BAM variants by seed")[1]  # no priors evaluated


def test_report_tables_bam_variants_along_one_setting_as_a_dose(grid, tmp_path):
    """Three or more BAM variants that differ in one numeric setting only (the prior's learning rate at x1,
    x3, x10) get one table against it, diverged seeds counted; variants that differ in more are not in it."""
    root = tmp_path / "runs"
    x3 = [fake_run(root, f"bam_ssmax_prior_lr3_seed{seed}", seed, [20, 15, 12], ["--train.prior_lr=9e-3"])
          for seed in (1, 2)]
    write_metrics(x3[1], [3.0] * 8, [])
    diverge(x3[1], 90)
    for run, retrieval, flat in zip(grid[:3] + x3[:1], [0, 0, 2, 1], [1, 0, 0, 0]):
        fake_priors(run, retrieval, flat)  # seed 1 of x1: no b <= 0 head, but one nearly flat prior
    out = tmp_path / "report.md"
    assert report.main([*dict.fromkeys(grid + x3), "--out", str(out), "--no_run_plots"]) == 0
    text = out.read_text().split("BAM variants along one setting, prior lr")[1]
    assert "| prior lr | variant | seeds | 512 (4x) | seeds with a b <= 0 head |" in text
    rows = [line for line in text.splitlines() if line.startswith("| prior lr x")]
    assert rows == ["| prior lr x1 | bam + ssmax | 3 | 37 [50 20 40] | 1 of 3 | 0 0 2 | 1.50 1.50 -0.30 | 1 0 2 |",
                    "| prior lr x3 | bam + ssmax, prior lr x3 | 1 (+1 diverged) | 60 [60] | 1 of 1 | 1 | -0.30 | 1 |",
                    "| prior lr x10 | bam + ssmax, prior lr x10 | 1 | 85 [85] | — | — | — | — |"]
    assert "init uniform" not in text and out.read_text().count("BAM variants along one setting") == 1
    # two values are not a line: without x3, no table
    assert report.main([*dict.fromkeys(grid), "--out", str(out), "--no_run_plots"]) == 0
    assert "along one setting" not in out.read_text()


def write_metrics(run, losses, val):
    """RUN/metrics.jsonl as train.py logs it: a loss every 10 steps, validation losses at some steps, and the
    steps after step 20 logged twice, as after a resume (the second, later row of a step wins)."""
    rows = [{"step": 0, "tokens": 0, "val_loss": 10.0}]
    rows += [{"step": 10 * (i + 1), "loss": 99.0, "tokens": 1} for i in range(2, len(losses))]  # replaced below
    rows += [{"step": 10 * (i + 1), "loss": loss, "tokens": 10 * (i + 1)} for i, loss in enumerate(losses)]
    rows += [{"step": step, "val_loss": v} for step, v in val]
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 1")  # a line cut short by a kill


def test_report_training_section_means_the_last_tenth_over_seeds_and_draws_the_curves(grid, tmp_path):
    from eval import training_section

    for run, offset in zip(grid[:3], [0.0, 0.3, 0.6]):  # bam_ssmax seeds 1-3: 20 losses, the last two 1+offset
        write_metrics(run, [3.0] * 18 + [1.0 + offset] * 2, [(100, 2.0 + offset), (200, 0.5 + offset)])
    out = tmp_path / "report.md"
    assert report.main([*dict.fromkeys(grid), "--out", str(out), "--no_run_plots"]) == 0
    text = out.read_text()
    # the last tenth of 20 logged steps is 2 steps: 1.0, 1.3, 1.6 -> mean 1.3; validation 0.5, 0.8, 1.1 -> 0.8
    assert "| bam + ssmax | 3 | 200 | every token | 1.300 [1.000 1.300 1.600] | 0.8000 [0.5000 0.8000 1.100] |" \
        in text, text
    section = text[text.index("## Training"):text.index("## Passkey")]
    assert "bam-local" not in section and "init uniform" not in section  # an override; no metrics.jsonl
    (train_steps, losses), (val_steps, val) = training_section.curves(os.path.join(grid[0], "metrics.jsonl"))
    assert train_steps == list(range(10, 210, 10)) and 99.0 not in losses  # a step's last row wins
    assert val_steps == [0, 100, 200] and val == [10.0, 2.0, 0.5]
    assert "![](report_training.png)" in text and (tmp_path / "report_training.png").stat().st_size > 10_000


def test_report_training_section_shows_a_loss_near_zero_and_what_it_is_taken_over(tmp_path):
    """The README quickstart's runs train on the passkey's answer tokens only (data.loss_on): their losses are near
    zero and printed as 0.000 for every run. Four significant digits show them, and the table says what each
    variant's loss is taken over."""
    root = tmp_path / "runs"
    answers = [fake_run(root, f"answers_seed{seed}", seed, [20, 10, 0], ["--data.loss_on=passkey_answers"])
               for seed in (1, 2)]
    every = fake_run(root, "bam_seed1", 1, [20, 20, 20])
    for run, end in zip(answers, [2.5e-4, 1.5e-4]):
        write_metrics(run, [3.0] * 18 + [end] * 2, [(200, end / 10)])
    write_metrics(every, [3.0] * 18 + [3.25] * 2, [(200, 3.5)])
    out = tmp_path / "report.md"
    assert report.main([*answers, every, "--out", str(out), "--no_run_plots"]) == 0
    section = out.read_text().split("## Training")[1].split("## Passkey")[0]
    assert "| variant | seeds | steps | loss over | training loss, end | validation loss, last |" in section
    assert "| bam + ssmax, loss on passkey_answers | 2 | 200 | passkey answers | 0.0002000 [0.0002500 0.0001500] | " \
           "2.000e-05 [2.500e-05 1.500e-05] |" in section, section
    assert "| bam + ssmax | 1 | 200 | every token | 3.250 | 3.500 |" in section, section
    assert "0.000 " not in section


def diverge(run, step):
    """RUN as configs/repro/grid5.sh keeps a run the guard stopped: metrics.jsonl ending in recovery.diverged's
    row, no checkpoints and no evaluation results: no eval/ folder either, as a clone of the repository has it
    (git keeps no empty folder)."""
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write("\n" + json.dumps({"step": step, "diverged": "loss 9 is more than 6 robust standard deviations"}) + "\n")
    shutil.rmtree(os.path.join(run, "eval"))


def test_report_training_section_shows_where_a_seed_diverged_and_averages_the_others(grid, tmp_path, capsys):
    for run, offset in zip(grid[:2], [0.0, 0.3]):
        write_metrics(run, [3.0] * 18 + [1.0 + offset] * 2, [(100, 2.0 + offset), (200, 0.5 + offset)])
    write_metrics(grid[2], [3.0] * 8, [(50, 2.9)])  # seed 3 stopped by the guard at step 90
    diverge(grid[2], 90)
    # and a variant none of whose seeds trained: no passkey anywhere, only its curve
    fox = fake_run(tmp_path / "runs", "fox_ssmax_seed1", 1, [0, 0, 0], ["--model.pe=fox"], checkpoints=False)
    write_metrics(fox, [3.0] * 5, [])
    diverge(fox, 60)
    out = tmp_path / "report.md"
    assert report.main([*dict.fromkeys(grid), fox, "--out", str(out), "--no_run_plots",
                        "--compare", "bam + ssmax", "bam + ssmax, init uniform"]) == 0
    text = out.read_text()
    # a diverged run has nothing to evaluate: the warning says why, not "run eval.passkey first"
    warnings = capsys.readouterr().err
    assert f"report: {grid[2]} diverged at step 90; it is in the training section only" in warnings
    assert "eval.passkey" not in warnings
    # the two seeds that trained to step 200 are averaged; the third is named with its step
    assert "| bam + ssmax | 3 | 200; seed 3 diverged at 90 | every token | 1.150 [1.000 1.300] | " \
           "0.6500 [0.5000 0.8000] |" in text, text
    assert "- bam_ssmax_seed3 (bam + ssmax) diverged at step 90: loss 9 is more than 6 robust" in text
    assert "| fox + ssmax | 1 | seed 1 diverged at 60 | every token | 3.000 |" in text
    passkey = text[text.index("## Passkey"):]
    # the diverged seed has no passkey: the two others make the variant's row and its comparison
    assert "| bam + ssmax | 2 | 98 [100 95] (" in passkey and "| 512 (4x) | 35 (2) | 95 (2) |" in passkey
    assert "fox" not in passkey.split("## Plots")[0]
    assert (tmp_path / "report_training.png").stat().st_size > 10_000


def test_shapes_in_training_counts_the_heads_that_reach_far_by_the_models_own_bias(tmp_path):
    """The summary figure's series from metrics.jsonl: smallest b, heads of b <= 0, and heads whose prior puts
    a key 1,024 tokens back within one logit of their best key, checked against the prior written out by
    hand, -e^a (|d - mu| + eps)^b (the log holds mu = 2 sinh(l) itself), maximised over every distance."""
    import math
    from eval.priors.plots import shapes_in_training
    from model import GGD_EPS
    shape, log_scale, mu = [[1.0, 0.5], [-0.2, 1.0]], [[0.0, -8.0], [0.0, -6.0]], [[0.0, 0.0], [0.0, 700.0]]
    bias = lambda d, b, a, m: -math.exp(a) * (abs(d - m) + GGD_EPS) ** b
    by_hand = sum(bias(1024, b, a, m) - max(bias(d, b, a, m) for d in range(1025)) > -1
                  for row in zip(shape, log_scale, mu) for b, a, m in zip(*row))
    # (0, 1): 1024^0.5 e^-8 = 0.011 below its best; (1, 0): b < 0, the far key is its best; (1, 1): |1024 - 700|
    # e^-6 = 0.8 below its best at 700 (taken as l, the location 2 sinh(700) would make the head count 0); but
    # (0, 0) costs 1,024
    assert by_hand == 3
    rows = [{"step": 10, "loss": 1.0, "prior": {"bam_shape": shape, "bam_log_scale": log_scale, "bam_loc": mu}},
            {"step": 20, "loss": 1.0, "prior": {"bam_shape": [[0.9, -0.7], [0.1, 1.0]]}}]  # an older log
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, smallest, retrieval, far = shapes_in_training(str(metrics), 1024)
    assert (steps, smallest, retrieval, far[0]) == ([10, 20], [-0.2, -0.7], [1, 1], by_hand) and math.isnan(far[1])
    assert all(map(math.isnan, shapes_in_training(str(metrics))[3]))  # no distance (no training context known)
    # a uniform start (b = 0, a flat prior at any scale) reaches any distance, as b < 0 does
    flat = {"bam_shape": [[0.0, 0.0]], "bam_log_scale": [[0.0, 3.0]], "bam_loc": [[0.0, 0.0]]}
    metrics.write_text(json.dumps({"step": 0, "prior": flat}) + "\n")
    assert shapes_in_training(str(metrics), 1024)[3] == [2]


def test_far_heads_are_counted_once_for_a_shared_prior_and_from_the_config_without_results(tmp_path):
    from eval.priors.section import far_heads_of
    from eval.runs import Run
    stopped = Run(str(tmp_path), str(tmp_path / "eval"), "stopped", {}, config={"model": {"block_size": 128}})
    assert stopped.pretraining_context == 128  # a diverged run has a config but no results to read it from
    run = Run(str(tmp_path), str(tmp_path / "eval"), "shared", {}, model={"config": {"block_size": 128}})
    heads = [{"layer": layer, "head": h, "shape": b, "log_scale": 0.0, "loc": 0.0}
             for layer in range(3) for h, b in enumerate([-0.3, 1.0])]
    run.results = {"priors": {"priors": {"shared_across_layers": True, "heads": heads}}}
    assert far_heads_of(run) == 1  # eval.priors lists the one prior per layer; it has 1 far head, not 3
    run.results["priors"]["priors"]["shared_across_layers"] = False
    assert far_heads_of(run) == 3


def test_the_quickstarts_report_names_its_flat_bam_start_though_no_other_bam_is_beside_it(tmp_path):
    # RUNS="rope bam_ssmax_uniform" bash configs/repro/run.sh: one BAM variant, started flat, not the paper's
    root = tmp_path / "runs"
    paths = [fake_run(root, "rope_seed1", 1, [20, 12, 2], ["--model.pe=rope", "--model.ssmax=false"]),
             fake_run(root, "bam_ssmax_uniform_seed1", 1, [20, 20, 20], ["--model.bam_init=uniform"])]
    out = tmp_path / "report.md"
    assert report.main([*paths, "--out", str(out), "--no_run_plots"]) == 0
    text = out.read_text()
    assert "| bam_ssmax_uniform_seed1 | bam + ssmax, init uniform | 1 |" in text
    assert "| rope_seed1 | rope | 1 |" in text
