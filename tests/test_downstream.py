"""eval.downstream: lm-evaluation-harness on the project model. Scores are checked against log-likelihoods
computed here directly from the model's logits, on a task defined for the test over local JSON files."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from bam.checkpoint import save_model
from bam.cli import run_cli
from bam.data import EOT
from bam.tokenizer import load_tokenizer
from eval import downstream, report
from eval.loading import autocast
from eval.options import EvalOptions
from tiny_models import GPT2_VOCAB, tiny_model

pytestmark = pytest.mark.slow  # lm-eval end to end, also from its command line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("river stone lamp orange quietly seven market winter glass thunder copper violin meadow "
         "sailor yellow whisper garden harbor number ancient").split()


def documents(n=24, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        question = "Question: " + " ".join(rng.choice(WORDS, rng.integers(3, 30))) + "?\nAnswer:"
        choices = [" ".join(rng.choice(WORDS, rng.integers(1, 6))) for _ in range(4)]
        docs.append({"question": question, "choices": choices, "answer": int(rng.integers(4))})
    return docs


def logprob(model, context, continuation):
    """Sum of log p(continuation | context): one forward over the whole sequence, no batching, no padding."""
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
    logp = F.log_softmax(logits[0].float(), dim=-1)
    positions = torch.arange(len(context) - 1, tokens.shape[1] - 1)
    return float(logp[positions, tokens[0, len(context):]].sum())


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    docs = documents()
    with open(root / "test.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    (root / "tasks").mkdir()
    (root / "tasks" / "bam_choice.yaml").write_text(
        "task: bam_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'test.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    model = tiny_model(vocab_size=GPT2_VOCAB, block_size=32, ssmax=True, bam_init="sampled").eval()
    save_model(model, str(root / "model.pt"))
    return root, docs, model


def test_loglikelihoods_equal_the_models_own(task):
    _, docs, model = task
    enc = load_tokenizer("gpt2")
    lm = downstream.make_project_lm(model, enc, max_length=24, batch_size=3, amp=autocast(torch.device("cpu"),
                                                                                          torch.float32))
    pairs = [(d["question"], " " + c) for d in docs[:6] for c in d["choices"]] + [("", "Hello world")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, args, i) for i, args in enumerate(pairs)])
    for (context, continuation), (value, _) in zip(pairs, got):
        ctx = enc.encode_ordinary(context) or [EOT]
        cont = enc.encode_ordinary(continuation)
        whole = (ctx + cont)[-25:]  # max_length 24 inputs: the context is cut from the left
        want = logprob(model, whole[:-len(cont)], cont)
        assert value == pytest.approx(want, rel=1e-5, abs=1e-4)
    assert any(len(enc.encode_ordinary(c + k)) > 25 for c, k in pairs)  # truncation was exercised

    text = " ".join(WORDS * 3)
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    tokens = enc.encode_ordinary(text)
    want = 0.0
    for start in range(0, len(tokens), 24):  # disjoint windows of 24 predictions, the first after <|endoftext|>
        window = tokens[start:start + 24]
        context = [EOT] if start == 0 else tokens[start + len(window) - 25:start]  # fills the input to 24
        want += logprob(model, context, window)
    assert rolling == pytest.approx(want, rel=1e-5)


def test_task_accuracy_equals_the_one_computed_from_the_models_loglikelihoods(task, tmp_path):
    root, docs, model = task
    enc = load_tokenizer("gpt2")
    correct = correct_norm = 0
    for d in docs:
        ctx = enc.encode_ordinary(d["question"])
        scores = [logprob(model, ctx, enc.encode_ordinary(" " + c)) for c in d["choices"]]
        norm = [s / len((" " + c).encode()) for s, c in zip(scores, d["choices"])]
        correct += int(np.argmax(scores)) == d["answer"]
        correct_norm += int(np.argmax(norm)) == d["answer"]
    done = subprocess.run([sys.executable, "-m", "eval.downstream", str(root / "model.pt"), "--tasks", "bam_choice",
                           "--include_path", str(root / "tasks"), "--batch_size", "5", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "downstream.json").read_text())
    assert saved["schema"] == "downstream" and saved["settings"]["tasks"] == ["bam_choice"]
    (row,) = saved["results"]
    assert row["task"] == "bam_choice" and row["samples"] == len(docs)
    assert row["metrics"]["acc"] == pytest.approx(correct / len(docs), abs=1e-12)
    assert row["metrics"]["acc_norm"] == pytest.approx(correct_norm / len(docs), abs=1e-12)
    assert row["metric"] == "acc_norm" and row["stderr"] > 0
    assert os.path.getsize(tmp_path / "downstream.png") > 1000
    assert "bam_choice" in done.stdout

    report.write_report([str(tmp_path)], out=str(tmp_path / "report.md"))
    text = (tmp_path / "report.md").read_text()
    assert "## Downstream tasks" in text and f"{100 * correct_norm / len(docs):.1f}" in text


def test_offline_hub_task_is_one_line(task, tmp_path):
    """A task whose data are on the Hub (ARC-Easy's own dataset), with the Hub unreachable: one line."""
    root, _, _ = task
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_arc.yaml").write_text(
        "task: hub_arc\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices.text}}'\ndoc_to_target: 0\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-m", "eval.downstream", str(root / "model.pt"), "--tasks", "hub_arc",
                           "--include_path", str(tmp_path / "tasks"), "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot download the data of hub_arc"), done.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # refused: nothing was created


class NoTasks:  # lm-eval's index without its ~15K built-in tasks, which take half a minute to scan
    def __init__(self, **kwargs):
        self.all_tasks, self.all_groups = ["hellaswag"], []


def test_bad_arguments_are_errors(task, monkeypatch):
    root, _, model = task
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", NoTasks)
    with pytest.raises(downstream.EvalError, match=r"unknown lm-eval task\(s\): no_such_task"):
        downstream.evaluate_downstream(model, options=EvalOptions(out=str(root / "unused"), verbose=False),
                                       tasks="hellaswag,no_such_task")
    for kwargs, message in ((dict(tasks=" , "), "no tasks given"), (dict(tasks="x", batch_size=0), "--batch_size"),
                            (dict(tasks="x", limit=-1), "--limit"), (dict(tasks="x", include_path="/nonexistent"),
                                                                     "--include_path")):
        with pytest.raises(downstream.EvalError, match=message):
            options = EvalOptions(batch_size=kwargs.pop("batch_size", None))  # the options' own check
            downstream.evaluate_downstream(model, options=options, **kwargs)


def test_a_refused_command_creates_no_output_folder(task, tmp_path, monkeypatch, capsys):
    """An unknown task is one line, and --out (with the folders above it) is not created for it: a refusal
    creates nothing."""
    root, _, _ = task
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", NoTasks)
    with pytest.raises(SystemExit) as info:
        run_cli(downstream.main, [str(root / "model.pt"), "--tasks", "rp3_no_such_task",
                                  "--out", str(tmp_path / "ds" / "unknown")])
    assert info.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: unknown lm-eval task(s): rp3_no_such_task; `lm-eval ls tasks` lists them"]
    assert os.listdir(tmp_path) == []


def test_downstream_is_held_to_the_evaluators_contract(task, tmp_path, monkeypatch, capsys):
    """--window and any --model.key=value reach the evaluated model and name the results file, as for every
    evaluator; an output folder that cannot be written is refused before a task is evaluated."""
    root, docs, _ = task
    common = [str(root / "model.pt"), "--tasks", "bam_choice", "--include_path", str(root / "tasks"), "--batch_size", "8"]
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(downstream, "run_tasks", lambda *a, **k: pytest.fail("evaluated before the folder was checked"))
    with pytest.raises(SystemExit) as info:
        run_cli(downstream.main, common + ["--out", str(tmp_path / "afile" / "x")])
    assert info.value.code == 1 and "cannot write results to" in capsys.readouterr().err
    monkeypatch.undo()

    seen = {}
    real = downstream.make_project_lm

    def spy(model, *args):
        seen["config"] = model.config
        return real(model, *args)

    monkeypatch.setattr(downstream, "make_project_lm", spy)
    downstream.main(common + ["--window", "4", "--model.rope_theta=1000", "--out", str(tmp_path / "out")])
    assert seen["config"].attn_window == 4 and seen["config"].rope_theta == 1000
    saved = json.loads((tmp_path / "out" / "downstream_window4_rope_theta1000.json").read_text())
    assert saved["settings"]["model_overrides"] == {"attn_window": 4, "rope_theta": 1000.0}
    assert saved["results"][0]["samples"] == len(docs)
    assert sorted(os.listdir(tmp_path / "out")) == ["downstream_window4_rope_theta1000.json",
                                                   "downstream_window4_rope_theta1000.png"]


def test_an_unreachable_hub_switches_to_offline_mode_at_once(monkeypatch):
    """The hub client would retry each file for half a minute, printing every retry, before our one line."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(downstream, "hub_reachable", lambda timeout=3.0: False)
    downstream.offline_if_unreachable()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
