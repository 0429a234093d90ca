"""eval/ and sample.py on CPU: exact prompts, a copying model that must score 100% and a random one that
must not, stable JSON, valid PNGs, the memory guard, and every command on a tiny checkpoint made here."""

import inspect
import json
import os
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bam import data
from bam.checkpoint import save_model
from bam.cli import run_cli
from bam.tokenizer import load_tokenizer
from eval import EvalError, attention, downstream, memory, niah, passkey, perplexity, priors, report
from eval.contract import Evaluator
from eval.loading import autocast
from eval.options import EvalOptions, overrides_label, overrides_suffix, results_name
from eval.prompts import encode_template, validation_tokens
from eval.results import SCHEMA_VERSION, Output, new_results
from eval.runs import load_runs
from eval.stats import binomial_interval
from eval.sweep import parse_lengths, sweep
from model import ModelConfig, Transformer, ggd_bias
from tiny_models import GPT2_VOCAB, tiny_model

pytestmark = pytest.mark.slow  # every evaluator end to end on checkpoints made here, and their command lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = GPT2_VOCAB  # prompts are GPT-2 text


class CopyModel(nn.Module):
    """A deterministic induction rule, as an ideal retrieval head would compute it: at each position,
    predict the token that followed the most recent earlier occurrence of the current trigram (else
    bigram, else token). It reads the key straight out of the information line, so it must score 100%."""

    def __init__(self, block_size=64):
        super().__init__()
        self.config = ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=1, n_embd=8, block_size=block_size)
        self.register_buffer("anchor", torch.zeros(()))  # gives the model a device

    @staticmethod
    def next_token(seq, t):
        for n in (3, 2, 1):
            if t + 1 >= n:
                windows = seq.unfold(0, n, 1)[:t - n + 1]  # windows ending before position t
                hits = (windows == seq[t - n + 1:t + 1]).all(dim=1).nonzero()
                if len(hits):
                    return int(seq[hits[-1, 0] + n])
        return 0

    def forward(self, idx, targets=None, doc_ids=None, last_k=None):
        B, T = idx.shape
        k = T if last_k is None else last_k
        logits = torch.zeros(B, k, VOCAB)
        for b in range(B):
            for j, t in enumerate(range(T - k, T)):
                logits[b, j, self.next_token(idx[b], t)] = 1.0
        return logits, None


def quiet(**options):
    """The options of an evaluation called from Python: no progress bar, nothing on stdout."""
    return EvalOptions(progress=False, verbose=False, **options)


def random_model(pe="bam", **fields):
    """A random BAM + SSMax model that reads GPT-2's ids, its BAM shapes ~ N(0, 1): heads in all three groups."""
    evaluated = dict(pe=pe, vocab_size=VOCAB, block_size=64, ssmax=True, bam_init="sampled")
    return tiny_model(**{**evaluated, **fields}).eval()


def assert_png(path):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01  # not a blank canvas


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Two run dirs with checkpoints written by save_model (BAM + SSMax and RoPE), a metrics.jsonl with prior
    rows, and a validation shard of real English text."""
    root = tmp_path_factory.mktemp("eval")
    enc = load_tokenizer("gpt2")
    with open(os.path.join(ROOT, "eval", "niah.py")) as f:  # any English prose will do
        prose = f.read()
    docs = [enc.encode_ordinary(prose[i:i + 6000]) for i in range(0, len(prose) - 6000, 1500)]
    stream = [t for doc in docs * 4 for t in [data.EOT] + doc]
    data.write_shard(str(root / "data" / "tiny_val_000000.bin"), stream)

    runs = {}
    for name, pe in (("bam", "bam"), ("rope", "rope")):
        run = root / name
        (run / "checkpoints").mkdir(parents=True)
        model = random_model(pe)
        save_model(model, str(run / "checkpoints" / "step_00000001.pt"))
        if pe == "bam":
            with open(run / "metrics.jsonl", "w") as f:
                for step in range(4):
                    with torch.no_grad():
                        for prior in model.priors:
                            prior.shape.sub_(0.05)
                    f.write(json.dumps({"step": step, "tokens": step * 1000, "prior": model.prior_summary()}) + "\n")
        runs[name] = str(run)
    return {"root": root, "data": str(root / "data"), **runs}


# ---------------------------------------------------------------------------------------------------
# Prompts


def test_lengths_parse_tokens_multiples_and_factors():
    assert parse_lengths("300,1K,0.5x,3x,1_000", 512) == [256, 300, 1000, 1024, 1536]
    assert parse_lengths(None, 512, max_factor=500) == [512 * f for f in (1, 2, 4, 8, 16, 32, 64, 128, 256)] + [256_000]
    assert parse_lengths("1M", 512) == [1 << 20]
    for bad in ("12q", "x", "-5", "0"):
        with pytest.raises(EvalError):
            parse_lengths(bad, 512)


@pytest.mark.parametrize("given", [0, 1])
def test_passkey_prompt_has_the_exact_length_and_the_key_at_the_depth(given):
    prompts = passkey.PasskeyPrompts(given_tokens=given)
    enc = prompts.enc
    lengths = [prompts.min_length(), prompts.min_length() + 1, 257, 1000, 4099]
    for length in lengths:
        for depth in (0.0, 0.3, 0.5, 0.77, 1.0):
            for key in (10000, 12345, 99999, 50505):
                sample = prompts.build(length, depth, key)
                key_tokens = enc.encode_ordinary(f" {key}")
                assert len(sample.tokens) - 1 == length  # the model reads exactly `length` tokens
                assert sample.tokens[0] == data.EOT
                pos = sample.meta["key_position"]
                assert sample.tokens[pos:pos + len(key_tokens)].tolist() == key_tokens  # as " {key}" alone
                # scored span: the key at the very end, minus the given tokens
                start, end = sample.spans[0]
                assert end == len(sample.tokens) and start == end - len(key_tokens) + given
                assert sample.tokens[end - len(key_tokens):].tolist() == key_tokens
                # the information line sits at the requested depth of the garbage, to within half a sentence
                info, slots = encode_template(enc, " " + passkey.INFO, {"key": key})
                n = length + 1 - len(prompts.head) - len(info) - len(prompts.question) - len(key_tokens)
                cut = round(sample.meta["actual_depth"] * n)
                assert pos == len(prompts.head) + cut + slots["key"][0][0]
                assert abs(cut - depth * n) <= 3
    # the information line reads back to the same tokens (no tokenisation seam at the key)
    info, _ = encode_template(enc, " " + passkey.INFO, {"key": 12345})
    assert enc.encode_ordinary(enc.decode(info)) == info
    text = enc.decode(prompts.build(1000, 0.5, 12345).tokens[1:].tolist())
    assert text.startswith(passkey.TASK) and passkey.INFO.format(key=12345) in text
    assert text.endswith(passkey.QUESTION + " 12345")


def test_key_position_follows_depth_and_prompts_are_seeded():
    prompts = passkey.PasskeyPrompts()
    samples = prompts.samples(2000, 9, "equidistant", seed=3)
    positions = [s.meta["key_position"] for s in samples]
    assert positions == sorted(positions) and positions[0] < 100 and positions[-1] > 1900
    again = prompts.samples(2000, 9, "equidistant", seed=3)
    assert all(np.array_equal(a.tokens, b.tokens) for a, b in zip(samples, again))
    other = prompts.samples(2000, 9, "equidistant", seed=4)
    assert [s.meta["key"] for s in other] != [s.meta["key"] for s in samples]
    assert {s.meta["depth"] for s in prompts.samples(500, 4, "beginning", 0)} == {0.0}
    assert {s.meta["depth"] for s in prompts.samples(500, 4, "end", 0)} == {1.0}
    assert len({s.meta["depth"] for s in prompts.samples(500, 6, "random", 0)}) == 6


@pytest.mark.parametrize("task", list(niah.TASKS))
@pytest.mark.parametrize("haystack", niah.HAYSTACKS)
def test_niah_prompts_are_exact_and_the_answers_are_in_the_haystack(task, haystack, workspace):
    prompts = niah.NeedlePrompts(validation_tokens(workspace["data"]))
    rng = np.random.default_rng(0)
    for length in (300, 1001):
        sample = prompts.build(task, haystack, length, rng)
        assert len(sample.tokens) - 1 == length
        assert sample.spans[-1][1] == len(sample.tokens)
        body = sample.tokens[:sample.spans[0][0]].tolist()
        for start, end in sample.spans:  # every scored value appears, tokenised alike, inside a needle
            value = sample.tokens[start:end].tolist()
            assert any(body[i:i + len(value)] == value for i in range(len(body) - len(value)))
        expected = {"multivalue": 4, "multiquery": 4}.get(task, 1)
        assert len(sample.spans) == expected
    assert prompts.build(task, haystack, 40, rng) is None  # too short: skipped, not wrong


# ---------------------------------------------------------------------------------------------------
# Scoring


PASSKEY_TOP = {"schema", "schema_version", "model", "settings", "results", "stopped", "complete"}
PASSKEY_SETTINGS = {"lengths", "samples", "depth_mode", "depth_bins", "seed", "digits", "given_tokens", "batch_size",
                    "stop_after_zero", "block_size", "device", "dtype", "attn_impl", "model_overrides", "torch"}
PASSKEY_ROW = {"length", "factor", "accuracy", "correct", "samples", "seconds", "by_depth", "records"}
PASSKEY_RECORD = {"depth", "actual_depth", "key", "key_position", "correct", "predicted"}
MODEL_BLOCK = {"checkpoint", "name", "config", "num_params", "num_params_non_embedding", "step", "tokens_seen",
               "data_dir", "tokenizer", "tokenizer_sha256"}


@pytest.mark.parametrize("given", [0, 1])
def test_copying_model_scores_100_percent(given, tmp_path):
    res = passkey.evaluate_passkey(CopyModel(), options=quiet(out=str(tmp_path)), lengths=[100, 700, 3000], samples=10,
                                   given_tokens=given)
    assert [r["accuracy"] for r in res["results"]] == [1.0, 1.0, 1.0]
    assert res["complete"] and res["stopped"] is None
    # the JSON schema is the contract report.py and users' scripts read
    saved = json.loads((tmp_path / passkey.default_name("equidistant", given)).with_suffix(".json").read_text())
    assert set(saved) == PASSKEY_TOP and saved["schema"] == "passkey" and saved["schema_version"] == 1
    assert set(saved["settings"]) == PASSKEY_SETTINGS and set(saved["model"]) == MODEL_BLOCK
    row = saved["results"][0]
    assert set(row) == PASSKEY_ROW and len(row["records"]) == 10 and len(row["by_depth"]) == 10
    assert set(row["records"][0]) == PASSKEY_RECORD
    assert set(row["by_depth"][0]) == {"bin", "samples", "correct", "accuracy"}
    assert sum(b["samples"] for b in row["by_depth"]) == 10
    assert_png(str(tmp_path / f"{passkey.default_name('equidistant', given)}.png"))


@pytest.mark.parametrize("given", [0, 1])
def test_random_model_scores_chance(given):
    res = passkey.evaluate_passkey(random_model(), options=quiet(), lengths=[128, 512], samples=16, given_tokens=given,
                                   stop_after_zero=0)
    assert all(r["accuracy"] <= 1 / 16 for r in res["results"])  # chance of 2+ exact tokens is ~1e-9


def test_runs_are_reproducible_and_stop_after_zero(tmp_path):
    kw = dict(lengths=[100, 200, 300, 400], samples=4)
    first = passkey.evaluate_passkey(random_model(), options=quiet(), stop_after_zero=0, **kw)
    second = passkey.evaluate_passkey(random_model(), options=quiet(), stop_after_zero=0, **kw)
    strip = lambda res: [{k: v for k, v in r.items() if k != "seconds"} for r in res["results"]]  # noqa: E731
    assert strip(first) == strip(second)
    stopped = passkey.evaluate_passkey(random_model(), options=quiet(out=str(tmp_path)), stop_after_zero=2, **kw)
    assert [r["length"] for r in stopped["results"]] == [100, 200]
    assert stopped["stopped"]["length"] == 300 and not stopped["complete"]


def test_niah_copying_model_retrieves_single_needles_and_random_model_does_not(tmp_path, workspace):
    tasks = ["single_number", "single_uuid"]
    kw = dict(lengths=[300, 1200], tasks=tasks, samples=4, data_dir=workspace["data"])
    good = niah.evaluate_niah(CopyModel(), options=quiet(out=str(tmp_path)), **kw)
    assert {(r["haystack"], r["task"]) for r in good["results"]} == {(h, t) for h in niah.HAYSTACKS for t in tasks}
    assert all(r["score"] == 1.0 for r in good["results"])
    bad = niah.evaluate_niah(random_model(), options=quiet(), stop_after_zero=0, **kw)
    assert all(r["score"] <= 0.25 for r in bad["results"])
    assert_png(str(tmp_path / "niah.png"))


def test_a_16k_token_passkey_prompt_runs_on_cpu():
    # BAM + SSMax: `auto` attention takes FlexAttention past 2K tokens; 1 layer of 2 heads keeps it quick
    model = random_model(n_layer=1, n_head=2, n_embd=16)
    assert memory.forward_bytes(model, 1, 16384, 3) < 2**30
    res = passkey.evaluate_passkey(model, options=quiet(), lengths=[16384], samples=1)
    assert res["results"][0]["length"] == 16384 and res["results"][0]["samples"] == 1


def test_the_sweep_saves_every_length_and_stops_after_zeros_or_when_memory_runs_out(tmp_path, capsys):
    def run(scores, stop_after_zero=2):
        measured = []

        def measure(length, bar):
            if measured:  # the previous lengths are on disk before the next one starts
                saved = json.loads((tmp_path / "sweep.json").read_text())
                assert [r["length"] for r in saved["results"] if r["part"] == 1] == measured
                assert len(saved["results"]) == 2 * len(measured) and not saved["complete"]
            measured.append(length)
            if scores[length] == "oom":
                raise memory.OutOfMemory(f"length {length} does not fit")
            return [{"length": length, "part": 0}, {"length": length, "part": 1}], scores[length]

        evaluator = Evaluator(name="sweep", title="Sweep", description="", add_arguments=None, run=None,
                              table=lambda r: "", plot=lambda r, path: open(path, "w").close(), section=None)
        output = Output(evaluator, str(tmp_path), "sweep", verbose=False)
        res = sweep(list(scores), measure, new_results("sweep", {"name": "m"}, {"s": 1}, results=[]), output,
                    work_per_length=1, stop_after_zero=stop_after_zero, progress=False)
        assert json.loads((tmp_path / "sweep.json").read_text()) == res and (tmp_path / "sweep.png").exists()
        assert res["schema"] == "sweep" and res["model"] == {"name": "m"} and res["settings"] == {"s": 1}
        return [r["length"] for r in res["results"] if r["part"] == 1], res["stopped"], res["complete"]

    # a length where nothing could be scored (None) or something was (0.5) breaks the streak of zeros
    assert run({1: 0, 2: None, 3: 0, 4: 0.5, 5: 0, 6: 0.0}) == ([1, 2, 3, 4, 5, 6], None, True)
    lengths, stopped, complete = run({1: 0.5, 2: 0, 3: 0, 4: 1})
    assert lengths == [1, 2, 3] and stopped["length"] == 4 and "2 lengths in a row" in stopped["reason"]
    assert run({1: 0, 2: 0, 3: 0}, stop_after_zero=0) == ([1, 2, 3], None, True)
    # the rows of the length that ran out of memory are dropped whole; the ones before it are kept
    lengths, stopped, complete = run({1: 1, 2: "oom", 3: 1})
    assert lengths == [1] and stopped == {"length": 2, "reason": "length 2 does not fit"} and not complete
    assert "sweep: stopped: length 2 does not fit" in capsys.readouterr().err


def test_evaluators_take_their_options_by_keyword_only():
    for evaluate in (passkey.evaluate_passkey, niah.evaluate_niah, perplexity.evaluate_perplexity,
                     priors.evaluate_priors, downstream.evaluate_downstream, attention.evaluate_attention,
                     report.write_report):
        first, *options = inspect.signature(evaluate).parameters.values()
        assert first.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, evaluate.__name__
        assert options and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options), evaluate.__name__


# ---------------------------------------------------------------------------------------------------
# Memory


def test_a_length_that_does_not_fit_stops_cleanly_and_keeps_the_results(tmp_path, monkeypatch, capsys):
    model = random_model()
    small, big = 128, 9000
    fits = memory.forward_bytes(model, 1, small, 3)
    assert memory.forward_bytes(model, 1, big, 3) > 2 * fits
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1.5 * fits / memory.SAFETY)
    res = passkey.evaluate_passkey(model, options=quiet(out=str(tmp_path)), lengths=[small, big], samples=2)
    assert [r["length"] for r in res["results"]] == [small]
    assert res["stopped"]["length"] == big and "GiB" in res["stopped"]["reason"]
    assert "stopped" in capsys.readouterr().err
    saved = json.loads((tmp_path / "passkey.json").read_text())
    assert saved["results"][0]["length"] == small and saved["stopped"]["length"] == big


def test_out_of_memory_during_a_forward_keeps_the_results(tmp_path):
    class RunsOutPastLength(CopyModel):
        def forward(self, idx, **kw):
            if idx.shape[1] > 500:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
            return super().forward(idx, **kw)

    res = passkey.evaluate_passkey(RunsOutPastLength(), options=quiet(out=str(tmp_path)), lengths=[200, 400, 800],
                                   samples=2)
    assert [r["accuracy"] for r in res["results"]] == [1.0, 1.0]
    assert res["stopped"]["length"] == 800 and "out of memory" in res["stopped"]["reason"]
    assert json.loads((tmp_path / "passkey.json").read_text())["stopped"]["length"] == 800


def test_batches_shrink_to_fit(monkeypatch):
    model = random_model()
    one = memory.forward_bytes(model, 1, 9000, 3)  # past 8K: no dense block mask, all of it per sequence
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2.5 * one / memory.SAFETY)
    assert memory.plan_batch(model, 8, 9000, 3, torch.device("cpu")) == 2
    monkeypatch.setattr(memory, "available_bytes", lambda device: 100 * one)
    assert memory.plan_batch(model, 8, 9000, 3, torch.device("cpu")) == 8
    monkeypatch.setattr(memory, "available_bytes", lambda device: 0.5 * one)
    with pytest.raises(memory.OutOfMemory):
        memory.plan_batch(model, 8, 9000, 3, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------
# Perplexity and priors


def test_windowed_loss_equals_the_full_cross_entropy(monkeypatch):
    model = random_model(n_layer=1)
    torch.manual_seed(1)
    seqs = torch.randint(0, 1000, (2, 97))
    monkeypatch.setattr(perplexity, "HEAD_CHUNK", 16)  # several LM-head chunks
    per_window = perplexity.window_nll(model, seqs, 32, autocast(torch.device("cpu"), torch.float32))
    with torch.no_grad():
        logits, _ = model(seqs[:, :-1])
    nll = F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten(), reduction="none").view(2, -1)
    expected = torch.stack([nll[:, s:s + 32].sum(dim=1) for s in range(0, 96, 32)], dim=1).double()
    torch.testing.assert_close(per_window, expected, rtol=1e-5, atol=1e-4)


def test_validation_sequences(workspace):
    concat = perplexity.validation_sequences(workspace["data"], 500, 3, "concat")
    assert concat.shape == (3, 501) and not (concat == data.EOT).any()
    docs = perplexity.validation_sequences(workspace["data"], 500, 2, "documents")
    assert docs.shape == (2, 501) and (docs[:, 0] == data.EOT).all() and not (docs[:, 1:] == data.EOT).any()
    with pytest.raises(EvalError):
        perplexity.validation_sequences(workspace["data"], 10**6, 1, "documents")


def test_prior_groups_and_curves_come_from_the_model():
    model = random_model(n_layer=1)
    with torch.no_grad():
        model.priors[0].shape.copy_(torch.tensor([1.2, 0.0, -0.3, -1.0]))
        model.priors[0].log_scale.copy_(torch.tensor([-2.0, -1.0, 0.5, 0.0]))
    res = priors.evaluate_priors(model, options=quiet(), max_distance=1000)
    assert res["groups"] == {"local": 1, "retrieval": 2, "aggressive": 1}
    assert [h["group"] for h in res["heads"]] == ["local", "retrieval", "retrieval", "aggressive"]
    shape, log_scale, loc = model.priors[0].tensors()
    for h in res["heads"]:
        expected = ggd_bias(torch.tensor(100.0), h["head"], shape, log_scale, loc).item()
        assert h["bias_at"]["100"] == pytest.approx(expected, rel=1e-5)
        assert h["scale"] == pytest.approx(np.exp(h["log_scale"]))


def test_priors_of_a_layer_pattern_skip_the_layers_without_one():
    """RoPE-window layers have no prior and no SSMax: no rows; the BAM + SSMax layer's curve is its own prior's."""
    model = random_model("rope", ssmax=False, n_layer=3, layer_pattern="rope@16*2 bam+ssmax")
    res = priors.evaluate_priors(model, options=quiet(), max_distance=1000)
    assert {h["layer"] for h in res["heads"]} == {2} and sum(res["groups"].values()) == 4
    assert res["layer_pattern"] == "rope@16*2 bam+ssmax" and res["ssmax"] and not res["shared_across_layers"]
    shape, log_scale, loc = model.prior_of_layer(2).tensors()
    for h in res["heads"]:
        expected = ggd_bias(torch.tensor(100.0), h["head"], shape, log_scale, loc).item()
        assert h["bias_at"]["100"] == pytest.approx(expected, rel=1e-5)
        assert h["ssmax_scale"] == pytest.approx(model.blocks[2].attn.ssmax_scale[h["head"]].item())  # moved off 1
    assert "layer_pattern='rope@16*2 bam+ssmax'" in priors.format_table(res)


def test_priors_of_a_model_without_one(capsys):
    assert priors.evaluate_priors(random_model("rope", ssmax=False)) is None
    assert "no learned positional prior" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Every command on the tiny checkpoints


def test_commands_on_tiny_checkpoints(workspace, tmp_path, capsys):
    bam, rope, data_dir = workspace["bam"], workspace["rope"], workspace["data"]
    assert passkey.main([bam, "--lengths", "128,2x,512", "--samples", "4", "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "| 128 | 2 |" in out and "wrote" in out
    assert passkey.main([rope, "--lengths", "128", "--samples", "2", "--given_tokens", "1", "--no_progress"]) == 0
    assert niah.main([bam, "--lengths", "300,600", "--samples", "2", "--data_dir", data_dir, "--no_progress"]) == 0
    compare = str(tmp_path / "cmp.png")
    assert perplexity.main([bam, rope, "--length", "4x", "--window", "64", "--num_seqs", "2", "--data_dir", data_dir,
                            "--compare", compare, "--no_progress"]) == 0
    assert priors.main([bam]) == 0
    assert priors.main([rope]) == 0  # no prior: a message, exit 0
    capsys.readouterr()

    ev = os.path.join(bam, "eval")
    for name in ("passkey", "niah", "perplexity", "priors", "priors_shapes", "priors_training"):
        assert_png(os.path.join(ev, f"{name}.png"))
    assert_png(os.path.join(ev, "priors.png"))
    assert_png(compare)
    assert_png(os.path.join(rope, "eval", "passkey_given1.png"))
    ppl = json.loads(open(os.path.join(ev, "perplexity.json")).read())
    assert ppl["sequences"] == 2 and len(ppl["windows"]) == 4 and ppl["windows"][-1]["end"] == 256
    niah_res = json.loads(open(os.path.join(ev, "niah.json")).read())
    assert {r["haystack"] for r in niah_res["results"]} == {"repeat", "text"}
    assert {r["task"] for r in niah_res["results"]} == set(niah.TASKS)

    out = str(tmp_path / "report" / "report.md")
    assert report.main([bam, rope, "--out", out]) == 0
    text = open(out).read()
    for heading in ("## Runs", "## Passkey retrieval", "## Needle in a haystack", "## Perplexity by position",
                    "## Learned priors", "## Plots"):
        assert heading in text
    assert "| 128 (2x) |" in text and "passkey_given1" in text
    assert "—" in text  # rope has no NIAH results and no prior: shown as missing, not a crash
    for link in [line.split("](")[1].split(")")[0] for line in text.splitlines() if "![](" in line]:
        assert os.path.isfile(os.path.join(os.path.dirname(out), link)), link
    assert_png(str(tmp_path / "report" / "report_passkey.png"))
    assert_png(str(tmp_path / "report" / "report_perplexity.png"))
    assert_png(str(tmp_path / "report" / "report_priors.png"))  # BAM's shapes against the step (eval.priors)
    # For a report kept apart from its runs (docs/): no link into the run folders.
    alone = str(tmp_path / "docs" / "report.md")
    assert report.main([bam, rope, "--out", alone, "--no_run_plots"]) == 0
    links = [line for line in open(alone).read().splitlines() if "![](" in line]
    assert links == ["![](report_passkey.png)", "![](report_perplexity.png)", "![](report_priors.png)"]


def test_sample_generates_reproducibly(workspace, capsys):
    import sample

    args = [workspace["bam"], "--prompt", "The pass key is", "--max_new_tokens", "8", "--seed", "1",
            "--num_samples", "2"]
    assert sample.main(args) == 0
    first = capsys.readouterr().out
    assert sample.main(args) == 0
    assert capsys.readouterr().out == first
    assert first.count("The pass key is") == 2 and "-" * 80 in first


def test_a_user_error_is_one_line_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "eval.passkey", "/no/such/run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: no checkpoint file or run directory at /no/such/run"


@pytest.mark.parametrize("module,args,message", [
    (passkey, ["{bam}", "--lengths", "12q"], "cannot read the length"),
    (passkey, ["{bam}", "--lengths", "10"], "too short for a passkey prompt"),
    (passkey, ["{bam}", "--depths", "middle"], "invalid choice"),
    (niah, ["{bam}", "--tasks", "haystack_soup"], "unknown task"),
    (niah, ["{bam}", "--haystacks", "text", "--data_dir", "/no/data"], "no validation shards"),
    (perplexity, ["{bam}", "--length", "1M", "--data_dir", "{data}"], "use a shorter --length"),
    (report, ["/no/such/run"], "no run directory"),
])
def test_user_errors_are_one_line(module, args, message, workspace, capsys):
    args = [a.format(bam=workspace["bam"], data=workspace["data"]) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main, args)
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------------
# Model overrides, binomial intervals


def test_binomial_interval_is_wilsons():
    z2 = 1.959963984540054 ** 2
    # Closed forms at the edges: 0 of n -> [0, z^2 / (n + z^2)], n of n -> [n / (n + z^2), 1]
    assert binomial_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert binomial_interval(20, 20) == pytest.approx((20 / (20 + z2), 1.0))
    assert binomial_interval(5, 10) == pytest.approx((0.2365931, 0.7634069), abs=1e-6)  # published value
    assert binomial_interval(3, 0) == (None, None)
    stats = pytest.importorskip("scipy.stats")
    for k, n in ((1, 10), (7, 20), (19, 20), (0, 3), (50, 200)):
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert binomial_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_override_names_and_labels():
    assert overrides_suffix({}) == "" and results_name("passkey", {}) == "passkey"
    assert results_name("passkey", {"rope_scaling": "yarn", "rope_factor": 16.0}) == "passkey_yarn_x16"
    assert results_name("niah", {"rope_factor": "auto", "rope_scaling": "yarn"}) == "niah_yarn_auto"
    assert results_name("passkey", {"attn_window": 512}) == "passkey_window512"
    assert overrides_suffix({"rope_theta": 1e6, "attn_window": 64}) == "window64_rope_theta1000000"
    assert overrides_label({"pe": "rope"}, {"rope_scaling": "yarn", "rope_factor": 16.0}) == "rope + YaRN x16"
    assert overrides_label({"pe": "rope"}, {"rope_scaling": "yarn", "rope_factor": "auto"}) == "rope + YaRN auto"
    assert overrides_label({"pe": "rope"}, {"rope_scaling": "dynamic_ntk"}) == "rope + dynamic NTK"
    assert overrides_label({"pe": "rope"}, {"attn_window": 512}) == "rope-local (W=512)"
    # a factor alone scales by the run's own method, and is named after it
    assert overrides_label({"pe": "rope", "rope_scaling": "yarn"}, {"rope_factor": "auto"}) == "rope + YaRN auto"
    assert overrides_label({"pe": "bam", "ssmax": True}, {}) == "bam + ssmax"
    # no overrides: a model trained with a scaling is named by it; plain RoPE's factor 1 is not a scaling
    assert overrides_label({"pe": "rope", "rope_scaling": "yarn", "rope_factor": 4.0}, {}) == "rope + YaRN x4"
    assert overrides_label({"pe": "rope", "rope_scaling": "none", "rope_factor": 1.0}, {}) == "rope"


def test_overrides_reach_the_model_are_recorded_and_named(workspace, tmp_path, capsys, monkeypatch):
    import shutil

    import sample

    run = str(tmp_path / "rope")
    shutil.copytree(workspace["rope"], run, ignore=shutil.ignore_patterns("eval"))  # other tests' results
    seen = []  # (tokens in, rope_factor, attn_window) at every forward: what the model was asked to do
    forward = Transformer.forward
    monkeypatch.setattr(Transformer, "forward", lambda self, idx, *a, **k: seen.append(
        (idx.shape[1], self.config.rope_factor, self.config.attn_window)) or forward(self, idx, *a, **k))
    common_args = ["--samples", "2", "--no_progress"]
    assert passkey.main([run, "--lengths", "128", *common_args]) == 0
    plain = open(os.path.join(run, "eval", "passkey.json")).read()
    assert passkey.main([run, "--lengths", "128,256", "--rope_scaling", "yarn", "--rope_factor", "auto",
                         *common_args]) == 0
    assert {(t, f) for t, f, _ in seen[1:]} == {(128, 2.0), (256, 4.0)}  # length / block_size 64, per length
    seen.clear()
    assert passkey.main([run, "--lengths", "128", "--window", "32", "--model.rope_theta=10000", *common_args]) == 0
    assert {w for _, _, w in seen} == {32}
    assert open(os.path.join(run, "eval", "passkey.json")).read() == plain  # the plain results are kept

    yarn = json.load(open(os.path.join(run, "eval", "passkey_yarn_auto.json")))
    assert yarn["settings"]["model_overrides"] == {"rope_scaling": "yarn", "rope_factor": "auto"}
    assert [r["rope_factor"] for r in yarn["results"]] == [2.0, 4.0]
    assert yarn["model"]["config"]["rope_factor"] == 1.0  # the model as trained
    local = json.load(open(os.path.join(run, "eval", "passkey_window32_rope_theta10000.json")))
    assert local["settings"]["model_overrides"] == {"attn_window": 32, "rope_theta": 10000.0}
    assert niah.main([run, "--lengths", "300", "--tasks", "single_number", "--haystacks", "repeat",
                      "--rope_scaling", "yarn", "--rope_factor", "4", *common_args]) == 0
    assert json.load(open(os.path.join(run, "eval", "niah_yarn_x4.json")))["settings"]["model_overrides"] == {
        "rope_scaling": "yarn", "rope_factor": 4.0}
    # eval.perplexity keeps --window for its own windows; the attention window is --attn_window there
    assert perplexity.main([run, "--length", "2x", "--window", "64", "--attn_window", "16", "--num_seqs", "1",
                            "--data_dir", workspace["data"], "--no_progress"]) == 0
    ppl = json.load(open(os.path.join(run, "eval", "perplexity_window16.json")))
    assert ppl["settings"]["window"] == 64 and ppl["settings"]["model_overrides"] == {"attn_window": 16}
    capsys.readouterr()

    # The report: one row per set of overrides, named after them, cells with interval and n
    out = str(tmp_path / "report.md")
    assert report.main([run, "--out", out]) == 0
    text = open(out).read()
    section = text.split("## Passkey")[1].split("## Needle")[0]
    assert [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| rope")] == [
        "| rope", "| rope: rope-local + ssmax (W=32, rope_theta=10000)", "| rope: rope + ssmax + YaRN auto"]
    # (W=16 has only perplexity and YaRN x4 only NIAH results, so neither is a passkey row)
    header = next(line for line in section.splitlines() if line.startswith("| run |"))
    assert header == "| run | 128 (2x) | 256 (4x) |"
    plain = next(line for line in section.splitlines() if line.startswith("| rope |"))
    assert plain.count("n=2)") == 1 and plain.endswith(" | — |"), plain  # the plain run has no 256 result

    assert sample.main([run, "--prompt", "Hi", "--max_new_tokens", "94", "--rope_scaling", "yarn",
                        "--rope_factor", "auto", "--model.rope_theta=1000"]) == 0
    # EOT + "Hi" + 94 new tokens = 1.5 x the context of 64
    assert "rope + ssmax + YaRN auto (rope_theta=1000) (rope_factor 1.5)" in capsys.readouterr().err


def test_attn_window_on_a_layer_pattern_reaches_only_words_without_a_window_and_the_label_names_it(
        workspace, tmp_path, capsys):
    """--attn_window on a patterned run was named "bam-local + ssmax (W=4)" though every word of its pattern names
    its own window and the flag changed nothing: refused in one line, nothing written. Where some words name
    none, those layers take it and the others keep theirs, and the label names the pattern."""
    from eval.loading import load_for_eval
    from eval.results import evaluated_name

    args = ["--length", "2x", "--window", "64", "--attn_window", "4", "--num_seqs", "1", "--data_dir",
            workspace["data"], "--no_progress"]
    every = tmp_path / "every"
    save_model(random_model(layer_pattern="rope@8 bam+ssmax@full"), str(every / "checkpoints" / "step_00000001.pt"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_cli(perplexity.main, [str(every), *args])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith(
        "error: --attn_window 4 would change no layer: every word of the model's layer_pattern "
        "'rope@8 bam+ssmax@full' names its own window"), err
    assert sorted(os.listdir(every)) == ["checkpoints"]

    some = tmp_path / "some"
    save_model(random_model(layer_pattern="rope@8 bam+ssmax"), str(some / "checkpoints" / "step_00000001.pt"))
    windowed = load_for_eval(str(some), quiet(model_overrides={"attn_window": 4})).model
    assert [kind.window for kind in windowed.config.layer_kinds] == [8, 4]
    assert perplexity.main([str(some), *args]) == 0
    results = json.load(open(some / "eval" / "perplexity_window4.json"))
    assert evaluated_name(results).endswith(" as bam + ssmax, layer pattern rope@8 bam+ssmax (W=4)"), \
        evaluated_name(results)
    assert overrides_label({"pe": "rope", "layer_pattern": "rope@64*2 nope@full"}, {}) == \
        "rope, layer pattern rope@64*2 nope@full"


@pytest.mark.parametrize("args,message", [
    (["--model.n_embd=64"], "model.n_embd cannot be overridden on a trained model"),
    (["--model.ssmax=false"], "model.ssmax cannot be overridden"),
    (["--model.nonsense=1"], "unknown key 'nonsense' in [model]"),
    (["--rope_factor", "fast"], "--rope_factor 'fast': use a number (16) or auto"),
    (["--model.attn_window=wide"], "[model] attn_window = 'wide'"),
    (["--train.lr=1"], "unrecognized arguments: --train.lr=1"),
    (["--rope_factor", "auto"], "--rope_factor auto needs a RoPE scaling method"),
    (["--rope_scaling", "dynamic_ntk", "--rope_factor", "auto"], "would scale dynamic_ntk twice"),
])
def test_bad_overrides_are_one_line(args, message, workspace, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(passkey.main, [workspace["rope"], "--lengths", "128", *args])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


def test_report_names_a_factor_by_the_runs_own_scaling_method(tmp_path):
    # A run fine-tuned with YaRN, evaluated with only --rope_factor auto: the row says YaRN, not "rope auto"
    folder = tmp_path / "rope_yarn_ft" / "eval"
    folder.mkdir(parents=True)
    config = {"pe": "rope", "ssmax": False, "rope_scaling": "yarn", "block_size": 512}
    for name, overrides in (("passkey", {}), ("passkey_rope_auto", {"rope_factor": "auto"})):
        (folder / f"{name}.json").write_text(json.dumps({
            "schema": "passkey", "schema_version": SCHEMA_VERSION, "model": {"config": config},
            "settings": {"model_overrides": overrides, "samples": 2, "depth_mode": "equidistant",
                         "given_tokens": 0},
            "results": [{"length": 1024, "correct": 1, "samples": 2}]}))
    runs = load_runs(str(tmp_path / "rope_yarn_ft"))
    assert [r.name for r in runs] == ["rope_yarn_ft", "rope_yarn_ft: rope + YaRN auto"]
