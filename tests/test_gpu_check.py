"""bench/gpu_check.py must not rot between GPU runs: its CPU quick mode runs every code path but CUDA's."""

import json
import os
import subprocess
import sys

import pytest

from model import PE_CHOICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_mode_runs_every_section_and_every_case_passes(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    markdown = (out / "gpu_check.md").read_text()

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
