"""bench/gpu_check.py must not rot between GPU runs: its CPU quick mode runs every code path but CUDA's, and
the record it keeps (a file rewritten after every case, one line per failure, the time limits) holds."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import model
from model import PE_CHOICES
from planted import checkout_like, snapshot

pytestmark = pytest.mark.slow  # bench.gpu_check's command line, torchrun and torch.compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One run of `--device cpu --quick` (every section), as CI runs it: (result, markdown, output folder)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), out


def test_quick_mode_runs_every_section_and_every_case_passes(quick_run):
    result, markdown, out = quick_run

    from bench.gpu_check import SECTIONS
    assert list(result["sections"]) == list(SECTIONS)
    assert result["failed"] == []
    for section in SECTIONS:
        cases = [c for c in result["cases"] if c["section"] == section]
        assert cases, f"section {section} ran no case"
        assert all(c["status"] == "pass" for c in cases), [c for c in cases if c["status"] != "pass"]
        assert f"## {section}" in markdown
    names = [c["name"] for c in result["cases"]]
    assert all(name in markdown for name in names)
    # the correctness grid follows model.PE_CHOICES: a new encoding is checked without editing the script
    for pe in PE_CHOICES:
        assert f"sdpa {pe} docs float32" in names and f"sdpa {pe}+ssmax docs bfloat16" in names
        assert f"sdpa {pe}+ssmax docs float32 attn_sink attn_gate" in names  # learned sinks and gates, issue 47
    flex = [c for c in result["cases"] if c["name"].startswith("flex ")]
    assert flex and all(c["pass"].startswith("fwd only") for c in flex)
    compiled = next(c for c in result["cases"] if c["name"].startswith("torch.compile(model)"))
    assert compiled["pass"].startswith("fwd+bwd") and compiled["tensors"] > 2
    training = [c for c in result["cases"] if c["name"].startswith("train ")]
    assert training and all(c["loss_falls"] and c["tokens_per_s"] > 0 for c in training)
    assert all(t["met"] is None for t in result["targets"])  # GPU targets are not judged on a CPU
    # prior tables: formula and table both timed; on a CPU repeated backward passes agree bit for bit
    tables = [c for c in result["cases"] if c["section"] == "prior_tables"]
    assert {c["name"].split(" ")[2] for c in tables if c["name"].startswith("bam+ssmax")} == {"formula", "table"}
    spread = [c for c in tables if "repeated backward" in c["name"]]
    assert len(spread) == 2 and all(c["max_rel_spread"] == 0 and c["bitwise_equal_to_first"] == "2/2" for c in spread)
    # FSDP on a world of one rank: the bf16 policy really computes in bf16, the DCP round trip is exact
    fsdp = {c["name"].split(" ")[1]: c for c in result["cases"] if c["section"] == "fsdp"}
    assert fsdp["(world"]["weights_in_forward"] == "bfloat16" and fsdp["(world"]["compiled"].startswith("per Block")
    assert fsdp["DCP"]["shards_equal"] and fsdp["DCP"]["joined_equal"]
    assert not os.path.exists(out / "fsdp_run")  # its checkpoint folder is removed again


def test_quick_mode_trains_with_train_py_under_torchrun_and_resumes(quick_run):
    """train_run: the demo corpus, then train.py under torchrun (one rank, gloo) with DDP, FSDP and FSDP +
    activation checkpointing, each validated and checkpointed; the DDP run resumed from its checkpoint."""
    result, markdown, out = quick_run
    cases = {c["name"]: c for c in result["cases"] if c["section"] == "train_run"}
    assert list(cases)[0].startswith("demo corpus") and cases[list(cases)[0]]["train_shards"] > 0
    runs = [c for name, c in cases.items() if name.startswith("torchrun train.py")]
    assert [c["name"].split(":")[0].removeprefix("torchrun train.py ") for c in runs] == \
        ["ddp", "ddp", "fsdp", "fsdp + activation checkpointing"]
    for case in runs:
        assert case["status"] == "pass" and case["checkpoint"] and case["finite"], case
        assert case["recompiles"] == 0 and case["graph_breaks"] == 0  # counted from TORCH_LOGS in its log
    resumed = runs[1]
    assert resumed["name"].endswith("--resume to 3") and resumed["resumed"] and resumed["rows_kept"]
    assert resumed["steps"] == 3 and set(resumed["val_losses"]) == {"0", "1", "2", "3"}
    for name in ("ddp", "fsdp", "fsdp_ac"):
        assert (out / "train_run" / name / "metrics.jsonl").exists()
        assert not (out / "train_run" / name / "checkpoints").exists()  # removed once read
    assert (out / "train_run" / "ddp_resume.log").read_text().count("resuming at step 2") == 1


def test_quick_mode_sweeps_the_passkey_forward_and_counts_compilations(quick_run):
    result, markdown, out = quick_run
    sweep = [c for c in result["cases"] if c["section"] == "long_context"]
    assert [c["tokens"] for c in sweep] == [256, 1000, 2000]
    assert all(c["compiled_graphs"] == 0 and c["recompiles"] == 0 for c in sweep)  # sdpa on the CPU: none
    # every case of every section records what it compiled
    assert all({"compiled_graphs", "recompiles", "graph_breaks"} <= set(c) for c in result["cases"]
               if c["status"] != "skipped")
    assert any(c["compiled_graphs"] > 0 for c in result["cases"] if c["section"] == "correctness")


def test_correctness_starts_with_the_compiled_model_then_the_token_feature_priors(quick_run):
    result, markdown, out = quick_run
    names = [c["name"] for c in result["cases"] if c["section"] == "correctness"]
    assert names[0].startswith("torch.compile(model)")
    patterns = [name.split(" ")[2] for name in names if name.split(" ")[1] == "pattern"]
    variants = [name.split(" ")[1].removesuffix("+ssmax") for name in names[1:len(names) - len(patterns)]]
    grid = [variant.split(",")[0] for variant in variants]
    token_feature = {pe for pe, enc in model.ENCODINGS.items()
                     if issubclass(enc, model.AdditivePrior) and not enc.DISTANCE_ONLY}
    assert token_feature and set(grid[:2 * len(token_feature)]) == token_feature
    assert set(grid) == set(model.ENCODINGS)
    # and each encoding's checked_settings (partial RoPE) beside its defaults
    assert set(variants) == {",".join([pe] + [f"{k}={v}" for k, v in settings.items()])
                             for pe, settings in model.CHECKED_SETTINGS}
    # then the per-layer patterns (model.layer_pattern), last
    from bench.gpu_check import LAYER_PATTERNS
    assert set(patterns) == set(LAYER_PATTERNS) and all(n.split(" ")[1] == "pattern" for n in names[-len(patterns):])


def test_every_case_is_written_before_the_next_and_a_stuck_one_is_stopped(tmp_path, monkeypatch):
    """A failure is recorded in one line and on disk before the next case starts; a case past its limit is
    stopped, and what no longer fits the budget is skipped."""
    from bench import gpu_check
    seen = {}

    def look():
        seen.update(json.loads((tmp_path / "gpu_check.json").read_text())["cases"][-1])
        return {}

    def breaks():
        raise RuntimeError("first line\nsecond line")

    def section(s, report):
        report.run("breaks", breaks)
        report.run("reads the file", look)
        report.run("hangs", lambda: time.sleep(60) or {}, expected_s=0.5)
        report.run("after", lambda: {}, expected_s=0.5)
    monkeypatch.setitem(gpu_check.SECTION_FUNCTIONS, "long_context", section)
    # The budget ends the hang (its own limit, 30 s past its expected time, lies beyond it) and leaves nothing for
    # "after". It is generous for the two cases before the hang: on a loaded machine "breaks" alone took 3 s, and a
    # 3-s budget skipped "reads the file".
    t0 = time.perf_counter()
    assert gpu_check.main(["--device", "cpu", "--quick", "--sections", "long_context", "--budget_s", "20",
                           "--out", str(tmp_path)]) == 1
    assert time.perf_counter() - t0 < 45
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(c["name"], c["status"]) for c in result["cases"]] == [
        ("breaks", "fail"), ("reads the file", "pass"), ("hangs", "fail"), ("after", "skipped")]
    assert seen["name"] == "breaks" and seen["error"] == "RuntimeError: first line"
    assert result["cases"][2]["error"].startswith("CaseTimeout: stopped at its time limit")
    assert result["failed"] == ["breaks", "hangs"] and "**FAIL**" in (tmp_path / "gpu_check.md").read_text()


def test_each_case_records_the_compilations_it_caused(tmp_path, monkeypatch):
    from bench import gpu_check
    scale = torch.compile(lambda x, k: x * k, backend="eager")

    def section(s, report):
        for k in (2, 3, 4):  # 3: a recompile, with k dynamic from then on; 4: the dynamic graph serves it
            report.run(f"k={k}", lambda k=k: {"sum": float(scale(torch.ones(2), k).sum())})
    monkeypatch.setitem(gpu_check.SECTION_FUNCTIONS, "long_context", section)
    assert gpu_check.main(["--device", "cpu", "--quick", "--sections", "long_context",
                           "--out", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert [(c["compiled_graphs"], c["recompiles"]) for c in cases] == [(1, 0), (1, 1), (0, 0)]


def test_train_run_without_data_fails_in_one_line_and_skips_the_runs(tmp_path):
    from bench.gpu_check import main
    empty = tmp_path / "no_shards"
    empty.mkdir()
    assert main(["--device", "cpu", "--quick", "--sections", "train_run", "--data_dir", str(empty),
                 "--out", str(tmp_path / "out")]) == 1
    cases = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["cases"]
    assert cases[0]["status"] == "fail"
    assert cases[0]["error"] == f"FileNotFoundError: --data_dir {empty} holds no *_train_*.bin shards"
    assert len(cases) == 5
    assert all(c["status"] == "skipped" and c["reason"] == "no demo corpus" for c in cases[1:])


def test_an_earlier_calls_runs_lose_their_checkpoints_and_nothing_else(tmp_path):
    """train_run starts over its runs of an earlier call (train.py refuses a folder with checkpoints): it removes
    the checkpoints train.py wrote there and nothing else, so a folder of the user's under --out keeps its files."""
    from bench.gpu_check import main
    run = tmp_path / "out" / "train_run" / "ddp"
    before = checkout_like(run)
    (run / "checkpoints").mkdir()
    for name in ("step_00000010.pt", "step_00000020.pt", "best.pt"):
        (run / "checkpoints" / name).write_bytes(b"weights")
    (run / "checkpoints" / "step_00000030").mkdir()  # an FSDP run's sharded checkpoint
    (run / "checkpoints" / "step_00000030" / "__0_0.distcp").write_bytes(b"shard")
    empty = tmp_path / "no_shards"
    empty.mkdir()
    assert main(["--device", "cpu", "--quick", "--sections", "train_run", "--data_dir", str(empty),
                 "--out", str(tmp_path / "out")]) == 1
    assert snapshot(run) == before


def test_a_failed_train_py_is_named_by_its_own_line():
    from bench.gpu_check import child_env, failure_line
    crashed = "\n".join(["step 1", "Traceback (most recent call last):",
                          '  File "train.py", line 9, in <module>',
                          "torch._dynamo.exc.Unsupported: HOP: Unsafe side effect",
                          "  Higher Order Operator: torch.utils.checkpoint.checkpoint", "",
                          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                          "train.py FAILED"])
    assert failure_line(crashed) == "torch._dynamo.exc.Unsupported: HOP: Unsafe side effect"
    assert failure_line("starting\nerror: data.data_dir = 'x' holds no shards\n") == \
        "error: data.data_dir = 'x' holds no shards"
    env = child_env(type("S", (), {"cuda": False})())
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # train.py would take a GPU wherever it sees one
    assert {"dynamo", "recompiles", "graph_breaks"} <= set(env["TORCH_LOGS"].split(","))


def test_zero_budget_skips_every_case_and_still_writes_both_files(tmp_path):
    from bench.gpu_check import main
    assert main(["--device", "cpu", "--quick", "--budget_s", "0", "--sections", "graphs,attention",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(result["sections"]) == ["graphs", "attention"]
    assert result["cases"] and all(c["status"] == "skipped" for c in result["cases"])
    assert "skipped" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "needs a CUDA GPU"),
    (["--device", "cpu", "--quick", "--sections", "graphs,nonsense"], "unknown section(s) nonsense"),
    (["--device", "cpu", "--quick", "--budget_s", "-1"], "argument --budget_s: '-1' is not allowed: a finite number >= 0"),
    (["--device", "tpu9", "--quick"], "is not a device"),
])
def test_bad_arguments_fail_with_one_line(tmp_path, capsys, argv, message):
    from bench.gpu_check import main
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing written before the arguments were checked


def test_out_must_be_a_folder(tmp_path, capsys):
    from bench.gpu_check import main
    existing = tmp_path / "a_file"
    existing.write_text("keep me")
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--quick", "--out", str(existing)])
    assert "is not a folder" in capsys.readouterr().err
    assert existing.read_text() == "keep me"
