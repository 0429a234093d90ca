"""bench/gpu_check must not rot between GPU runs. Its CPU quick mode runs every code path but CUDA's, rehearsed
here in an environment shaped like the GPU machine the acceptance run goes to (issue 57): the repository's files
and the prepared folder alone, a Python without `datasets` and `wandb`, no network, and an output folder of at
most 8 files. The record it keeps (files rewritten after every case, one line per failure, the time limits, the
exit statuses) and its plan are held here too."""

import contextlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import time

import pytest
import torch
from torch._dynamo.utils import counters

import model
from bench.attention import documents
from bench.gpu_check import cli, long_context, preflight, train_run
from bench.gpu_check.common import BF16_FLOOR, LAYER_PATTERNS, Setup, rel_err, static_kernels
from bench.gpu_check.report import (EXIT_FAILED, EXIT_NOT_MEASURED, EXIT_PASSED, EXIT_PREFLIGHT, EXIT_USAGE,
                                    REPORT_FILES, Case, Report, Section)
from model import ATTENTION, PE_CHOICES, AttnContext, dense_mask, positions_in_documents, ssmax_log_n
from planted import checkout_like, snapshot

pytestmark = pytest.mark.slow  # bench.gpu_check's command line, torchrun and torch.compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the GPU machine of issue 57 lacks, and what comes back from it.
ABSENT = ("datasets", "wandb")
FILES_BACK, FOLDERS_DEEP, CARRIED_MIB = 8, 2, 64
# Loaded in every process of the rehearsal (PYTHONPATH): any connection or name lookup past this machine is
# written to $NETWORK_LOG and refused. torchrun's rendezvous and gloo stay on this machine.
NETWORK_AUDIT = '''
import os, socket, sys
_log, _own = os.environ["NETWORK_LOG"], {"localhost", socket.gethostname(), socket.getfqdn()}
def _local(host):
    host = str(host)
    return host in _own or host.startswith("127.") or host in ("::1", "0.0.0.0", "", "None")
def _audit(event, args):
    if event == "socket.getaddrinfo" and not _local(args[0]) or \\
            event == "socket.connect" and isinstance(args[1], tuple) and not _local(args[1][0]):
        with open(_log, "a") as f:
            f.write(f"{os.getpid()} {event} {args[1] if event == 'socket.connect' else args[0]}\\n")
        raise OSError(f"the rehearsal has no network ({event})")
sys.addaudithook(_audit)
'''


def venv_without(path, absent):
    """A virtual environment of this Python with every installed package of this one but `absent`: its
    site-packages links to each of this environment's entries (packages, their .dist-info, .pth files) except
    those, so `import datasets` fails there as on a machine where it was never installed. Building it from
    wheels would need the network, and hiding the modules behind an import hook would leave them findable."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = str(path / "bin" / "python")
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    pattern = re.compile(rf"({'|'.join(absent)})([-_.]|$)")
    sources = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    for folder in filter(os.path.isdir, sources):
        for entry in os.listdir(folder):
            link = os.path.join(target, entry)
            if not pattern.match(entry.lower()) and not os.path.lexists(link):
                os.symlink(os.path.join(folder, entry), link)
    return python


def repository_copy(dest):
    """The repository as it travels to the GPU machine: its files, without the ignored folders."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "data", "runs", "out", "wandb", "__pycache__",
                                                             ".pytest_cache", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The preparation command on this machine, then the acceptance command in quick mode as the GPU machine
    would run it: (result, markdown, output folder, rehearsal folder)."""
    base = tmp_path_factory.mktemp("rehearsal")
    repo = repository_copy(base / "repo")
    prepared = subprocess.run([sys.executable, "-m", "bench.gpu_check.prepare"], cwd=repo, capture_output=True,
                              text=True, timeout=600)
    assert prepared.returncode == 0, prepared.stdout[-2000:] + prepared.stderr[-2000:]
    python = venv_without(base / "venv", ABSENT)
    (base / "audit").mkdir()
    (base / "audit" / "sitecustomize.py").write_text(NETWORK_AUDIT)
    (base / "empty").mkdir()
    unreachable = "http://127.0.0.1:9"
    env = {**os.environ, "PYTHONPATH": str(base / "audit"), "NETWORK_LOG": str(base / "network.log"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HOME": str(base / "empty"),
           "XDG_CACHE_HOME": str(base / "empty"), "TIKTOKEN_CACHE_DIR": str(base / "empty"),
           # GPT-2's ranks are not brought along: a load would fail at once, not reach for a network
           "BAM_GPT2_TIKTOKEN": str(base / "empty" / "gpt2.tiktoken"),
           **{name: unreachable for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}}
    env.pop("NO_PROXY", None), env.pop("no_proxy", None)
    out = base / "OUT"
    # a --work_dir that already holds a folder of the user's where a run of an earlier call would be
    planted = checkout_like(base / "work" / "train_run" / "ddp")
    proc = subprocess.run([python, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out),
                           "--work_dir", str(base / "work")], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900)
    assert snapshot(base / "work" / "train_run" / "ddp") == planted  # the run wrote its own folder beside it
    assert [p.name.startswith("gpu_check_") for p in (base / "work").iterdir()].count(True) == 1
    assert proc.returncode == EXIT_PASSED, proc.stdout[-4000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text(), out, base


def test_the_rehearsal_runs_without_datasets_wandb_or_a_network_and_sends_back_three_files(rehearsal):
    result, markdown, out, base = rehearsal
    python = str(base / "venv" / "bin" / "python")
    for name in ABSENT:  # the rehearsal's Python really lacks them
        probe = subprocess.run([python, "-c", f"import {name}"], capture_output=True, text=True)
        assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr
    assert not (base / "network.log").exists(), (base / "network.log").read_text()
    files = [os.path.relpath(os.path.join(d, f), out) for d, _, names in os.walk(out) for f in names]
    assert sorted(files) == sorted(REPORT_FILES) and len(files) <= FILES_BACK
    assert all(f.count(os.sep) <= FOLDERS_DEEP for f in files)
    prepared = base / "repo" / "data" / "gpu_check"
    size = sum(p.stat().st_size for p in prepared.rglob("*") if p.is_file())
    assert 0 < size < CARRIED_MIB * 2**20 / 4  # well under what the GPU machine takes along
    corpus = next(c for c in result["cases"] if c["section"] == "train_run")
    assert corpus["data_dir"] == os.path.join("data", "gpu_check", "demo")  # the prepared folder, by default
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        names = tar.getnames()
    assert "train_run/ddp.log" in names and "train_run/ddp/metrics.jsonl" in names
    assert not [n for n in names if n.endswith(".bin") or "checkpoints" in n]  # no shards, no checkpoints
    assert [n for n in names if n.endswith("_torchrun.log")] == ["train_run/ddp_torchrun.log"]  # one torchrun start
    assert result["exit_status"] == EXIT_PASSED and "**Exit status 0:" in markdown
    assert result["not_measured"] == [] and "Preflight:" in markdown
    assert "prepared data: data/gpu_check/demo" in markdown


def test_quick_mode_runs_every_section_and_every_case_passes(rehearsal):
    result, markdown, out, base = rehearsal
    assert list(result["sections"]) == list(cli.SECTIONS)
    assert result["failed"] == []
    for section in cli.SECTIONS:
        cases = [c for c in result["cases"] if c["section"] == section]
        assert cases, f"section {section} ran no case"
        assert all(c["status"] == "pass" for c in cases), [c for c in cases if c["status"] != "pass"]
        assert f"## {section}" in markdown
    assert all(c["name"] in markdown for c in result["cases"])
    compiled = next(c for c in result["cases"] if c["name"].startswith("torch.compile(model)"))
    assert compiled["pass"].startswith("fwd+bwd") and compiled["tensors"] > 2
    training = [c for c in result["cases"] if c["name"].startswith("train ")]
    assert training and all(c["loss_falls"] and c["tokens_per_s"] > 0 for c in training)
    assert result["targets"] and all(t["met"] is None for t in result["targets"])  # a CPU does not judge a GPU's
    # prior tables: formula and table both timed; on a CPU repeated backward passes agree bit for bit
    tables = [c for c in result["cases"] if c["section"] == "prior_tables"]
    assert {c["name"].split(" ")[2] for c in tables if c["name"].startswith("bam+ssmax")} == {"formula", "table"}
    spread = [c for c in tables if "repeated backward" in c["name"]]
    assert len(spread) == 2 and all(c["max_rel_spread"] == 0 and c["bitwise_equal_to_first"] == "2/2" for c in spread)
    # FSDP on a world of one rank: the bf16 policy really computes in bf16, the DCP round trip is exact
    fsdp = {c["name"].split(" ")[1]: c for c in result["cases"] if c["section"] == "fsdp"}
    assert fsdp["(world"]["weights_in_forward"] == "bfloat16" and fsdp["(world"]["compiled"].startswith("per Block")
    assert fsdp["DCP"]["shards_equal"] and fsdp["DCP"]["joined_equal"]


def test_quick_mode_checks_the_flex_variants_on_tiny_shapes_before_train_py(rehearsal):
    result, markdown, out, base = rehearsal
    sections = list(result["sections"])
    assert sections.index("flex_variants") < sections.index("train_run")
    cases = [c for c in result["cases"] if c["section"] == "flex_variants"]
    variants = ("bam+ssmax (table)", "fire+ssmax", "fox+ssmax", "bam+ssmax attn_sink attn_gate",
                "pattern bam+ssmax-global")
    assert [c["name"] for c in cases] == [f"flex {name} docs bfloat16" for name in variants]
    assert all(c["pass"].startswith("fwd only") and c["worst_rel_err"] <= c["tol"] for c in cases)
    assert all(c["compiled_graphs"] > 0 for c in cases)  # the flex kernels, traced (aot_eager on a CPU)


def test_quick_mode_trains_with_train_py_under_one_torchrun_start_and_resumes(rehearsal):
    """train_run: the prepared corpus, then train.py in a rank torchrun starts (one rank, gloo): DDP and FSDP +
    activation checkpointing, each validated and checkpointed; the DDP run resumed from its checkpoint."""
    result, markdown, out, base = rehearsal
    cases = {c["name"]: c for c in result["cases"] if c["section"] == "train_run"}
    assert list(cases)[0] == "prepared demo corpus" and cases["prepared demo corpus"]["train_shards"] > 0
    runs = [c for name, c in cases.items() if name.startswith("torchrun train.py")]
    assert [c["name"].split(":")[0].removeprefix("torchrun train.py ") for c in runs] == \
        ["ddp", "ddp", "fsdp + activation checkpointing"]
    for case in runs:
        assert case["status"] == "pass" and case["checkpoint"] and case["finite"], case
        assert case["recompiles"] == 0 and case["graph_breaks"] == 0  # counted from TORCH_LOGS in its log
    resumed = runs[1]
    assert resumed["name"].endswith("--resume to 3") and resumed["resumed"] and resumed["rows_kept"]
    assert resumed["steps"] == 3 and set(resumed["val_losses"]) == {"0", "1", "2", "3"}
    assert runs[0]["steps"] == 2 and set(runs[0]["val_losses"]) == {"0", "1", "2"}  # as it was before the resume
    with tarfile.open(out / "gpu_check_logs.tar.gz") as tar:
        assert tar.extractfile("train_run/ddp_resume.log").read().decode().count("resuming at step 2") == 1


def test_quick_mode_sweeps_the_passkey_forward_and_compares_long_rows_with_dense_ones(rehearsal):
    result, markdown, out, base = rehearsal
    cases = [c for c in result["cases"] if c["section"] == "long_context"]
    sweep = [c for c in cases if c["name"].startswith("passkey")]
    assert [c["tokens"] for c in sweep] == [256, 1000, 2000]
    assert all(c["compiled_graphs"] == 0 and c["recompiles"] == 0 for c in sweep)  # sdpa on the CPU: none
    rows = [c for c in cases if c["name"].startswith("flex rows")]
    assert [c["name"].split(": ")[1] for c in rows] == ["bam+ssmax table bfloat16", "bam+ssmax table docs bfloat16"] * 2
    assert all(c["worst_rel_err"] <= c["tol"] and c["compiled_graphs"] > 0 for c in rows)
    assert len(rows[1]["rows"].split(", ")) == 4  # the last two, a document's first, one in a document's middle
    # every case of every section records what it compiled
    assert all({"compiled_graphs", "recompiles", "graph_breaks"} <= set(c) for c in result["cases"])


# ---------------------------------------------------------------------------------------------------
# The plan


def plan_of(*argv):
    args = cli.parse_args(["--plan", *argv])
    return cli.build_plan(Setup(args), args.section_list)


def test_the_default_plan_measures_what_a_user_needs_first_within_its_budget(capsys):
    plan = plan_of()
    assert [section.name for section, _ in plan] == ["training", "flex_cost", "flex_variants", "train_run",
                                                    "long_context", "correctness"]
    total = sum(c.expected_s for _, cases in plan for c in cases)
    assert total <= cli.ACCEPTANCE_BUDGET_S
    names = {section.name: [c.name for c in cases] for section, cases in plan}
    assert names["training"][0] == "train bam+ssmax" and "train rope" in names["training"]
    assert plan[0][1][0].expected_s >= 100  # a cold compile of the 121M model fits its limit
    assert "bam+ssmax flex table T=1024" in names["flex_cost"] and "fire+ssmax flex T=1024" in names["flex_cost"]
    assert len(names["flex_variants"]) == 5
    assert sum(name.startswith("flex rows vs dense") for name in names["long_context"]) == 4
    assert [n for n in names["long_context"] if n.startswith("passkey")] == \
        [f"passkey forward {n:,} tokens" for n in (4000, 16000, 256000)]
    assert names["correctness"] == ["torch.compile(model) flex bam+ssmax docs float32"]
    # opt-in: what another case covers
    everything = {c.name for _, cases in plan_of("--all") for c in cases} - {n for v in names.values() for n in v}
    assert {"torch.compile(model) flex bam+ssmax docs bfloat16", "passkey forward 64,000 tokens",
            "passkey forward 128,000 tokens", "torchrun train.py fsdp: 4 steps, validation, checkpoint",
            "torchrun train.py fsdp: --resume to 6",
            "torchrun train.py fsdp + activation checkpointing: --resume to 6"} <= everything
    assert cli.main(["--plan"]) == 0
    printed = capsys.readouterr().out
    assert f"total: {total:.0f} s expected" in printed and "flex_variants" in printed and "--all adds" in printed


def test_the_correctness_grid_on_request_follows_the_registry():
    """--all: every encoding of model.PE_CHOICES and its checked_settings, the token-feature priors first, the
    per-layer patterns last; a new encoding is checked without editing the script."""
    plan = dict((section.name, cases) for section, cases in plan_of("--all"))
    names = [c.name for c in plan["correctness"]]
    assert names[0].startswith("torch.compile(model)")
    grid = [n for n in names if n.startswith("flex ") and " pattern " not in n]
    variants = [n.split(" ")[1].removesuffix("+ssmax") for n in grid]
    token_feature = {pe for pe, enc in model.ENCODINGS.items()
                     if issubclass(enc, model.AdditivePrior) and not enc.DISTANCE_ONLY}
    assert token_feature and {v.split(",")[0] for v in variants[:4 * len(token_feature)]} == token_feature
    assert {v.split(",")[0] for v in variants} == set(PE_CHOICES)
    assert set(variants) == {",".join([pe] + [f"{k}={v}" for k, v in settings.items()])
                             for pe, settings in model.CHECKED_SETTINGS}
    for pe in PE_CHOICES:
        assert f"flex {pe}+ssmax docs bfloat16 attn_sink attn_gate" in names
    patterns = [n for n in names if n.split(" ")[1] == "pattern"]
    assert {n.split(" ")[2] for n in patterns} == set(LAYER_PATTERNS) and names[-len(patterns):] == patterns


# ---------------------------------------------------------------------------------------------------
# The record and the exit status


def one_section(monkeypatch, cases, name="long_context"):
    monkeypatch.setitem(cli.SECTIONS, name, Section(name, lambda s: cases, default=True))


def test_every_case_is_written_before_the_next_and_a_stuck_one_is_stopped(tmp_path):
    """A failure is recorded in one line and on disk before the next case starts; a case past its limit is
    stopped, and what no longer fits the budget is skipped."""
    seen = {}

    def look():
        seen.update(json.loads((tmp_path / "gpu_check.json").read_text())["cases"][-1])
        return {}

    def breaks():
        raise RuntimeError("first line\nsecond line")

    cases = [Case("breaks", 0, breaks), Case("reads the file", 0, look),
             Case("hangs", 0.5, lambda: time.sleep(60) or {}), Case("after", 0.5, lambda: {})]
    # The budget ends the hang (its own limit, 30 s past its expected time, lies beyond it) and leaves nothing for
    # "after". 20 s leave the two cases before it room on a loaded machine: at 6 s, with five other jobs on the
    # two cores, writing the first failure's record took 3.4 s and the hang was skipped instead of stopped.
    report = Report(str(tmp_path), str(tmp_path / "work"), {"device_name": "test", "torch": "", "cuda": None,
                                                            "python": "", "quick": True, "peak_tflops": None,
                                                            "budget_s": 20}, [(Section("s", None, True), cases)], 20)
    (tmp_path / "work").mkdir()
    report.begin_section("s")
    t0 = time.perf_counter()
    for case in cases:
        report.run(case)
    report.end_section()
    assert time.perf_counter() - t0 < 45  # the hang was stopped (it sleeps 60 s)
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(c["name"], c["status"]) for c in result["cases"]] == [
        ("breaks", "fail"), ("reads the file", "pass"), ("hangs", "stopped"), ("after", "skipped")]
    assert seen["name"] == "breaks" and seen["error"] == "RuntimeError: first line"
    assert result["cases"][2]["error"].startswith("CaseTimeout: stopped at its time limit")
    assert result["failed"] == ["breaks"] and result["exit_status"] == EXIT_FAILED
    assert [line.split(":")[0] for line in result["not_measured"]] == ["hangs (stopped", "after (skipped"]
    assert "second line" in (tmp_path / "work" / "tracebacks.log").read_text()  # the whole traceback, archived
    with tarfile.open(tmp_path / "gpu_check_logs.tar.gz") as tar:
        assert tar.getnames() == ["tracebacks.log"]
    assert "**FAIL**" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.parametrize("outcome,status", [
    ("passes", EXIT_PASSED), ("misses its target", EXIT_FAILED), ("measures no target", EXIT_NOT_MEASURED),
    ("is skipped", EXIT_NOT_MEASURED), ("fails", EXIT_FAILED)])
def test_the_exit_status_says_whether_every_target_was_measured_and_met(tmp_path, outcome, status):
    reports = []

    def measure():
        if outcome == "fails":
            return {"ok": False}
        if outcome != "measures no target":
            reports[-1].target("speed", 2.0, ">= 1", outcome == "passes")
        return {}
    plan = [(Section("s", None, True), [Case("measures", 1, measure, targets=("speed",))])]
    env = {"device_name": "GPU", "torch": "", "cuda": "13.0", "python": "", "quick": False, "peak_tflops": 989,
           "budget_s": 10}
    reports.append(Report(str(tmp_path), None, env, plan, 0 if outcome == "is skipped" else 10))
    reports[-1].begin_section("s")
    reports[-1].run(plan[0][1][0])
    assert reports[-1].exit_status() == status
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert f"**Exit status {status}:" in markdown
    if status == EXIT_NOT_MEASURED:
        assert "Not measured:" in markdown and ("target: speed" in markdown or "measures (skipped" in markdown)
    # on a CPU the targets are shown, not judged
    os.makedirs(tmp_path / "cpu")
    cpu = Report(str(tmp_path / "cpu"), None, {**env, "quick": True}, plan, None, judged=False)
    reports.append(cpu)
    cpu.begin_section("s")
    cpu.run(plan[0][1][0])
    assert cpu.exit_status() == (EXIT_FAILED if outcome == "fails" else EXIT_NOT_MEASURED
                                 if outcome == "measures no target" else EXIT_PASSED)


def test_zero_budget_skips_every_case_reports_it_not_measured_and_still_writes_the_files(tmp_path):
    assert cli.main(["--device", "cpu", "--quick", "--budget_s", "0", "--sections", "graphs,attention",
                     "--out", str(tmp_path)]) == EXIT_NOT_MEASURED
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(result["sections"]) == ["graphs", "attention"]
    assert result["cases"] and all(c["status"] == "skipped" for c in result["cases"])
    assert len(result["not_measured"]) == len(result["cases"])
    assert "Not measured:" in (tmp_path / "gpu_check.md").read_text()
    assert sorted(os.listdir(tmp_path)) == sorted(REPORT_FILES)  # the archive too, empty: no log was written


def test_each_case_records_the_compilations_it_caused(tmp_path, monkeypatch):
    scale = torch.compile(lambda x, k: x * k, backend="eager")
    # 3: a recompile, with k dynamic from then on; 4: the dynamic graph serves it
    one_section(monkeypatch, [Case(f"k={k}", 0, lambda k=k: {"sum": float(scale(torch.ones(2), k).sum())})
                              for k in (2, 3, 4)])
    assert cli.main(["--device", "cpu", "--quick", "--sections", "long_context", "--out", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "gpu_check.json").read_text())["cases"]
    assert [(c["compiled_graphs"], c["recompiles"]) for c in cases] == [(1, 0), (1, 1), (0, 0)]


def test_static_kernels_compile_each_shape_of_its_own():
    """flex_cost times each length on a kernel compiled for it alone, not on the dynamic-shape kernel a second
    shape would otherwise make (and that would serve the third)."""
    def graphs_for_three_lengths(context):
        torch._dynamo.reset()
        double = torch.compile(lambda x: x * 2, backend="eager")
        before = counters["stats"]["unique_graphs"]
        with context:
            for n in (4, 8, 16):
                double(torch.ones(n))
        return counters["stats"]["unique_graphs"] - before
    assert graphs_for_three_lengths(static_kernels(None)) == 3
    assert graphs_for_three_lengths(contextlib.nullcontext()) == 2


def test_the_preflight_stops_a_run_without_its_data_in_one_line_with_the_fix(tmp_path, capsys):
    empty = tmp_path / "no_shards"
    empty.mkdir()
    assert cli.main(["--device", "cpu", "--quick", "--sections", "graphs,train_run", "--data_dir", str(empty),
                     "--out", str(tmp_path / "out")]) == EXIT_PREFLIGHT
    err = capsys.readouterr().err
    assert f"error: no prepared data in {empty}" in err and "python -m bench.gpu_check.prepare" in err
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["cases"] == [] and result["exit_status"] == EXIT_PREFLIGHT
    assert "PROBLEM: no prepared data" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_the_preflight_names_an_unsupported_torch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "torch_requirement", lambda: ">=99.0")
    assert cli.main(["--device", "cpu", "--quick", "--sections", "graphs", "--out", str(tmp_path)]) == EXIT_PREFLIGHT
    assert f"error: torch {torch.__version__} (requirements.txt: torch>=99.0): install a torch>=99.0 build" in \
        capsys.readouterr().err


def test_the_preflight_lists_the_gpu_run_needs_on_a_machine_without_one(tmp_path):
    args = cli.parse_args(["--out", str(tmp_path)])
    lines, problems = preflight.preflight(Setup(args), args.section_list, str(tmp_path))
    assert lines[0].startswith("Python ") and lines[1].startswith(f"torch {torch.__version__}")
    assert any("sees no GPU" in p or "is a CPU build" in p for p in problems)  # the tests see no GPU


@pytest.mark.parametrize("device,selected", [("cuda", []), ("cuda:1", [1])])
def test_the_default_device_is_selected_as_torch_accepts_it(monkeypatch, device, selected):
    """A GPU-only line the CPU cannot run: torch.cuda.set_device refuses `cuda` without an index (its own
    argument check runs here, on the CPU), which would end the acceptance run in its first second."""
    calls = []

    def set_device(device):
        calls.append(torch.cuda._utils._get_device_index(device))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    cli.select_device(Setup(cli.parse_args(["--plan", "--device", device])))
    assert calls == selected


def test_dense_rows_are_the_eager_reference_and_a_one_token_shift_is_caught():
    """The long-context check's reference, on a length where the eager path's T x T scores are affordable: the
    same rows as eager attention, and a document boundary one token late is far outside the tolerance."""
    T, H = 300, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, 48, generator=g) for _ in range(3))
    doc_ids = documents(1, T, "cpu")
    prior, scale = long_context.gentle_bam(H, "cpu")
    pos = torch.arange(T)
    pos_in_doc = positions_in_documents(doc_ids)
    ctx = AttnContext("eager", pos, pos, dense_mask(pos, pos, 0, doc_ids), ssmax_log_n(pos_in_doc), None,
                      pos_in_doc=pos_in_doc)
    with torch.no_grad():
        eager = ATTENTION["eager"](q, k, v, ctx, prior, scale)  # fp32: what a float64 reference is held to
        rows = long_context.query_rows(T, doc_ids)
        dense = long_context.dense_rows(q, k, v, rows, prior, scale, doc_ids)
        late = doc_ids.clone()
        late[0, rows[1]] -= 1  # the last document starts one token late
        shifted = long_context.dense_rows(q, k, v, rows, prior, scale, late)
    assert max(rel_err(dense[h], eager[0, h, rows]) for h in range(H)) < 1e-5
    assert max(rel_err(shifted[h], eager[0, h, rows]) for h in range(H)) > 10 * BF16_FLOOR


def test_a_failed_train_py_is_named_by_its_own_line():
    crashed = "\n".join(["step 1", "Traceback (most recent call last):",
                          '  File "train.py", line 9, in <module>',
                          "torch._dynamo.exc.Unsupported: HOP: Unsafe side effect",
                          "  Higher Order Operator: torch.utils.checkpoint.checkpoint", "",
                          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                          "train.py FAILED"])
    assert train_run.failure_line(crashed) == "torch._dynamo.exc.Unsupported: HOP: Unsafe side effect"
    assert train_run.failure_line("starting\nerror: data.data_dir = 'x' holds no shards\n") == \
        "error: data.data_dir = 'x' holds no shards"
    env = train_run.child_env(type("S", (), {"cuda": False})())
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # train.py would take a GPU wherever it sees one
    assert {"dynamo", "recompiles", "graph_breaks"} <= set(env["TORCH_LOGS"].split(","))


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "needs a CUDA GPU"),
    (["--device", "cpu", "--quick", "--sections", "graphs,nonsense"], "unknown section(s) nonsense"),
    (["--device", "cpu", "--quick", "--budget_s", "-1"],
     "argument --budget_s: '-1' is not allowed: a finite number >= 0"),
    (["--device", "tpu9", "--quick"], "is not a device"),
])
def test_bad_arguments_fail_with_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv + ["--out", str(tmp_path / "out")])
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()  # nothing written before the arguments were checked


def test_out_and_work_dir_must_be_folders_apart(tmp_path, capsys):
    existing = tmp_path / "a_file"
    existing.write_text("keep me")
    for argv, message in ((["--out", str(existing)], "is not a folder"),
                          (["--out", str(tmp_path / "o"), "--work_dir", str(tmp_path / "o" / "w")], "must lie apart"),
                          ([], "--out is required")):
        with pytest.raises(SystemExit):
            cli.main(["--device", "cpu", "--quick", *argv])
        assert message in capsys.readouterr().err
    assert existing.read_text() == "keep me" and not (tmp_path / "o").exists()
