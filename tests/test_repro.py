"""configs/repro/run.sh end to end, shortened: prepare the passkey corpus, train two encodings for a
few steps, evaluate them and write the comparison report. Checks the pipeline, not the accuracies."""

import json
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow  # the configs/repro shell scripts, run end to end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def comparisons(report):
    """The comparison lines of an eval.report report (a path): one per pair of variants it was asked for."""
    return [line for line in open(report, encoding="utf-8").read().splitlines() if "** against **" in line]


def test_repro_pipeline_smoke(tmp_path):
    # JOBS=2: the two runs train side by side, each logging to <run>.log
    env = dict(os.environ, OUT=str(tmp_path / "runs"), DATA=str(tmp_path / "data"), STEPS="2",
               LENGTHS="128,256", SAMPLES="2", RUNS="rope bam_ssmax@2", JOBS="2", TOKENS="200000",
               # passed to every train.py; validation on 4,096 tokens, not base.toml's 32,768: the test checks the
               # pipeline, not the losses
               TRAIN_ARGS="--train.spike_threshold=0 --train.spike_window=50 --train.val_tokens=4096")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "run.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = tmp_path / "runs"
    for name in ("rope_seed1", "bam_ssmax_seed2"):
        result = json.loads((runs / name / "eval" / "passkey.json").read_text())
        assert [r["length"] for r in result["results"]] == [128, 256]
        assert (runs / name / "eval" / "passkey.png").stat().st_size > 0
        assert "== passkey" in (runs / f"{name}.log").read_text()
    assert (runs / "bam_ssmax_seed2" / "eval" / "priors.png").exists()
    config = (runs / "bam_ssmax_seed2" / "config.toml").read_text()
    assert "seed = 2" in config and "spike_threshold = 0.0" in config and "spike_window = 50" in config
    report = (runs / "report.md").read_text()
    assert "rope_seed1" in report and "bam_ssmax_seed2" in report

    # The same command again carries the grid on: finished training resumes to its end, complete passkey
    # results and the priors drawn after the last checkpoint are kept (not recomputed), and a passkey result
    # for other settings is redone.
    kept = (runs / "rope_seed1" / "eval" / "passkey.json").read_bytes()
    (runs / "bam_ssmax_seed2" / "eval" / "passkey.json").write_text(
        (runs / "bam_ssmax_seed2" / "eval" / "passkey.json").read_text().replace('"samples": 2', '"samples": 3'))
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "run.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passkey.json complete, kept" in (runs / "rope_seed1.log").read_text()
    assert (runs / "rope_seed1" / "eval" / "passkey.json").read_bytes() == kept
    assert "passkey.json complete, kept" not in (runs / "bam_ssmax_seed2.log").read_text()
    assert "priors.json newer than the newest checkpoint, kept" in (runs / "bam_ssmax_seed2.log").read_text()
    assert json.loads((runs / "bam_ssmax_seed2" / "eval" / "passkey.json").read_text())["settings"]["samples"] == 2

    # configs/repro/rope_extensions.sh on the same grid: RoPE's scaling methods at evaluation time, and a
    # YaRN fine-tune at 4x the context from the seed-1 weights (train.init_from)
    env.update(FT_STEPS="2", FT_TOKENS="200000", FT_DATA=str(tmp_path / "data512"))
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "rope_extensions.sh")], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = runs / "rope_seed1" / "eval"
    for name, overrides in [("passkey_window128", {"attn_window": 128}),
                            ("passkey_linear_auto", {"rope_scaling": "linear", "rope_factor": "auto"}),
                            ("passkey_ntk_auto", {"rope_scaling": "ntk", "rope_factor": "auto"}),
                            ("passkey_yarn_auto", {"rope_scaling": "yarn", "rope_factor": "auto"}),
                            ("passkey_dynamic_ntk", {"rope_scaling": "dynamic_ntk"})]:
        result = json.loads((evals / f"{name}.json").read_text())
        assert result["settings"]["model_overrides"] == overrides
        assert [r["length"] for r in result["results"]] == [128, 256]
    ft = runs / "rope_yarn_ft_seed1"
    config = (ft / "config.toml").read_text()
    assert 'init_from = "' in config and "block_size = 512" in config and 'rope_scaling = "yarn"' in config
    assert [r["length"] for r in json.loads((ft / "eval" / "passkey.json").read_text())["results"]] == [128, 256]


def test_unknown_run_name_is_one_clear_error(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "runs"), DATA=str(tmp_path / "data"), RUNS="rope bogus@3")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "run.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == "error: no configs/repro/bogus.toml (a name in RUNS)"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()  # checked before any work


def test_rope_extensions_skip_unfinished_runs_and_check_methods(tmp_path):
    # A RoPE run the grid is still training (its passkey result is not complete) is left alone, so the
    # extensions may run beside run.sh; an unknown method is refused before any work.
    (tmp_path / "runs" / "rope_seed3" / "checkpoints").mkdir(parents=True)
    script = os.path.join(ROOT, "configs", "repro", "rope_extensions.sh")
    env = dict(os.environ, OUT=str(tmp_path / "runs"), METHODS="linear yarn", FINE_TUNE="0")
    proc = subprocess.run(["bash", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rope_seed3: not finished by the grid" in proc.stdout
    assert not (tmp_path / "runs" / "rope_seed3" / "eval").exists()
    env["METHODS"] = "yarn pi"
    proc = subprocess.run(["bash", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: METHODS has pi; allowed: window linear ntk yarn dynamic_ntk"


def test_grid5_keeps_finished_runs_and_skips_kept_ones(tmp_path):
    # configs/repro/grid5.sh without training anything: a run already kept in RESULTS is skipped (the YaRN
    # fine-tune too), and the collect step copies what finished in OUT: a passkey complete at the grid's
    # lengths (the fine-tune's among them, whose context is 512 and whose lengths are the pretraining
    # context's 1x..64x in tokens), a run the divergence guard stopped, and not a run still training.
    kept = os.path.join(ROOT, "docs", "repro", "runs5", "nope_seed1")
    results, out = tmp_path / "results", tmp_path / "runs"
    shutil.copytree(kept, results / "nope_seed1")
    passkey = json.loads(open(os.path.join(kept, "eval", "passkey.json")).read())

    def finished(name, passkey=None, last_row=None):
        run = out / name
        shutil.copytree(kept, run, ignore=shutil.ignore_patterns("*.json"))
        if passkey is not None:
            (run / "eval" / "passkey.json").write_text(json.dumps(passkey))
        if last_row is not None:
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps(last_row) + "\n")

    ft_passkey = dict(passkey, settings=dict(passkey["settings"], block_size=512))
    finished("rope_yarn_ft_seed1", dict(ft_passkey, written_in="OUT"))
    # the fine-tune is kept in RESULTS already, so RoPE seed 1's checkpoints here do not start it again
    shutil.copytree(out / "rope_yarn_ft_seed1", results / "rope_yarn_ft_seed1")
    (results / "rope_yarn_ft_seed1" / "eval" / "passkey.json").write_text(json.dumps(ft_passkey))
    (out / "rope_seed1" / "checkpoints").mkdir(parents=True)  # still training: no passkey yet
    finished("bam_seed3", last_row={"step": 254, "diverged": "loss 5.9 is more than 6 robust standard deviations"})
    finished("alibi_seed2", dict(passkey, complete=False))
    env = dict(os.environ, RESULTS=str(results), OUT=str(out), REPORT=str(tmp_path / "report.md"),
               RUNS="nope@1")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "grid5.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert f"== nope@1: kept in {results}" in proc.stderr, proc.stdout + proc.stderr
    assert "started" not in proc.stdout  # nothing trained
    assert "rope_seed1: not finished by the grid" in proc.stdout and "== fine-tune" not in proc.stdout
    assert json.loads((results / "rope_yarn_ft_seed1" / "eval" / "passkey.json").read_text())["written_in"] == "OUT"
    assert "diverged" in (results / "bam_seed3" / "metrics.jsonl").read_text().splitlines()[-1]
    assert not (results / "alibi_seed2").exists()
    assert sorted(p.name for p in results.iterdir()) == ["bam_seed3", "nope_seed1", "rope_yarn_ft_seed1"]
    # a grid this partial still reports: a comparison is made only when both its variants have a result
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = (tmp_path / "report.md").read_text()
    assert "| nope |" in report and "** against **" not in report, report


def test_grid5_reports_the_kept_grid_with_every_comparison_of_the_committed_report(tmp_path):
    # the kept results regenerate the committed report's comparisons, each pair of variant names resolved
    # (eval.report refuses an unknown one) and none left out by a name mapped to the wrong config
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "docs", "repro", "runs5"), results)
    env = dict(os.environ, RESULTS=str(results), OUT=str(tmp_path / "runs"), REPORT=str(tmp_path / "report.md"),
               RUNS="nope@1")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "grid5.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    made = comparisons(tmp_path / "report.md")
    assert len(made) > 40 and made == comparisons(os.path.join(ROOT, "docs", "repro", "report5.md"))


def test_drope_reports_the_kept_results_with_every_comparison_of_the_committed_report(tmp_path):
    # drope.sh on a copy of its kept results, asked for exactly the runs kept there: nothing trains (the RoPE
    # runs' checkpoints are not in git), and the report has the committed report's comparisons, each pair of
    # variant names resolved by eval.report
    kept = os.path.join(ROOT, "docs", "repro", "runs5_drope")
    results = tmp_path / "results"
    shutil.copytree(kept, results)

    def names(folder):  # the configs of the runs kept in folder
        return " ".join(sorted({n.rsplit("_seed", 1)[0] for n in os.listdir(folder) if "_seed" in n}))

    scratch = [n for n in os.listdir(kept) if n.startswith("scratch_")]
    env = dict(os.environ, RESULTS=str(results), REPORT=str(tmp_path / "report.md"), SRC=str(tmp_path / "src"),
               OUT=str(tmp_path / "out"), TARGETS=" ".join(n for n in names(kept).split() if n.startswith("drope_")),
               SCRATCH=names(os.path.join(kept, scratch[0])) if scratch else " ")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "drope.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "src").exists() and not (tmp_path / "out").exists()  # nothing trained

    made = comparisons(tmp_path / "report.md")
    assert len(made) >= 8 and made == comparisons(os.path.join(ROOT, "docs", "repro", "report5_drope.md"))


def test_grid5_at_another_budget_keeps_its_runs_apart_and_reports_them_beside_the_grids(tmp_path):
    # STEPS=10000 (the paper's budget): its own runs, results and report, the grid's 2,000-step runs of the same
    # variants beside them in that report, each variant named by its budget.
    grid, results = tmp_path / "grid", tmp_path / "results"
    kept = os.path.join(ROOT, "docs", "repro", "runs5", "nope_seed1")
    shutil.copytree(kept, grid / "nope_seed1")
    # every BAM run of the grid is reported too (one figure of every BAM run's shapes); its other runs are not
    shutil.copytree(os.path.join(ROOT, "docs", "repro", "runs5", "bam_ssmax_prior_lr3_seed1"),
                    grid / "bam_ssmax_prior_lr3_seed1")
    shutil.copytree(os.path.join(ROOT, "docs", "repro", "runs5", "alibi_seed1"), grid / "alibi_seed1")
    shutil.copytree(kept, results / "nope_seed1")
    config = results / "nope_seed1" / "config.toml"
    config.write_text(config.read_text().replace("max_steps = 2000", "max_steps = 10000"))
    env = dict(os.environ, STEPS="10000", RESULTS=str(results), GRID=str(grid), OUT=str(tmp_path / "runs"),
               REPORT=str(tmp_path / "report.md"), RUNS="nope@1")
    proc = subprocess.run(["bash", os.path.join(ROOT, "configs", "repro", "grid5.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"== nope@1: kept in {results}" in proc.stderr, proc.stdout + proc.stderr
    report = (tmp_path / "report.md").read_text()
    assert "| nope, 10,000 steps |" in report and "| nope, 2,000 steps |" in report, report
    assert "10,000 steps against the grid's 2,000" in report
    assert "| bam_ssmax_prior_lr3_seed1 | bam + ssmax, prior lr x3 |" in report and "alibi" not in report
    assert (tmp_path / "report_priors.png").stat().st_size > 10_000
