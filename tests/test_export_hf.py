"""export_hf.py: an exported folder computes what the project's model computes, for every encoding x SSMax,
loads with transformers alone (no repository on sys.path), and its tokenizer gives the project's ids."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import fields

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_outputs import CausalLMOutputWithPast

import export_hf
from bam.checkpoint import save_model
from planted import NOTES, checkout_like, snapshot
from bam.data import EOT
from bam.tokenizer import gpt2_encoding, load_tokenizer
from model import PE_CHOICES, ModelConfig
from tiny_models import GPT2_VOCAB, batch, relative_error, tiny_model

pytestmark = pytest.mark.slow  # exports loaded by transformers, in clean interpreters among them

# transformers' name for the KV cache, as argument and in the output: 5.17's `past_key_values`, 5.24's `cache`
# (modeling_bam.py reads it the same way)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FIELDS = {f.name for f in fields(ModelConfig)}
CASES = {f"{pe}{'_ssmax' if ssmax else ''}": dict(pe=pe, ssmax=ssmax) for pe in PE_CHOICES for ssmax in (False, True)}
CASES["bam_ssmax_gqa"] = dict(pe="bam", ssmax=True, n_kv_head=2, bam_per_layer=False)
# learned sinks (their logits moved off 0 by tests/tiny_models.py's tiny_model) and gated attention (issue 47)
CASES["bam_ssmax_sink_gate"] = dict(pe="bam", ssmax=True, attn_sink=True, attn_gate=True)
# QK-norm (its gains moved off 1 by exported_model) under a prior and SSMax; Qwen3's, imported, in test_import_hf.py
CASES["bam_ssmax_qk_norm"] = dict(pe="bam", ssmax=True, qk_norm=True)
# Config fields that model.py is gaining; the cases run as soon as it has them (until then: a visible skip).
WINDOW_AND_SCALING = {"bam_ssmax_window": dict(pe="bam", ssmax=True, attn_window=8),
                      "rope_yarn": dict(pe="rope", rope_scaling="yarn", rope_factor=4.0),
                      "rope_partial_yarn": dict(pe="rope", rope_fraction=0.5, rope_scaling="yarn", rope_factor=4.0)}
TEXT = ("The quick brown fox jumps over the lazy dog. It's 2024, isn't it?\n\n"
        "  Indented line with trailing spaces   \n\tTabs\tand 1234567 digits; émigré café naïve — “quotes” ✓ 日本語.\n"
        "<|endoftext|>A second document starts here.\r\n\r\nWith CRLF, URLs like https://x.org/a?b=1, and   \n\n\n"
        "ending whitespace  ")


def exported_model(seed=0, **config):
    """A tiny model that reads GPT-2's ids (the tokenizer an export ships), its priors, SSMax scales, sinks and
    QK-norm gains moved off their init as trained ones would be, so that a value lost on the way cannot go
    unnoticed."""
    model = tiny_model(seed, **{"vocab_size": GPT2_VOCAB, **config})
    with torch.no_grad():  # tiny_model leaves the QK-norm gains at 1 (tests/model/test_qk_norm.py checks that init)
        for name, p in model.named_parameters():
            if ".q_norm." in name or ".k_norm." in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def export_case(tmp_path, name, **kw):
    model = exported_model(**kw)
    ckpt = tmp_path / f"{name}.pt"
    save_model(model, str(ckpt))
    out = tmp_path / name
    export_hf.export(str(ckpt), str(out))
    return model, out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: export_case(root, name, **kw) for name, kw in CASES.items()}


def assert_same_model(model, hf_model):
    x, _ = batch(T=24, vocab=GPT2_VOCAB)
    with torch.no_grad():
        want, _ = model(x)
        got = hf_model(x).logits
    rel = relative_error(got, want, norm="max")
    assert rel < 1e-5, rel
    prompt, _ = batch(B=1, T=7, seed=2, vocab=GPT2_VOCAB)
    want_ids = model.generate(prompt, 20, temperature=0)
    got_ids = hf_model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(got_ids, want_ids)


@pytest.mark.parametrize("name", list(CASES))
def test_exported_model_matches_logits_and_greedy_generation(name, exported):
    model, out = exported[name]
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf_model).__module__.startswith("transformers_modules.")  # the folder's copy, not ours
    assert hf_model.config.bam_model == {k: getattr(model.config, k) for k in CONFIG_FIELDS}
    assert_same_model(model, hf_model)


@pytest.mark.parametrize("name", list(WINDOW_AND_SCALING))
def test_window_and_rope_scaling_are_exported(name, tmp_path):
    kw = WINDOW_AND_SCALING[name]
    model, out = export_case(tmp_path, name, **kw)
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert {k: hf_model.config.bam_model[k] for k in kw} == kw
    assert_same_model(model, hf_model)


# Per-layer patterns (ModelConfig.layer_pattern): RNoPE-SWA, and BAM + SSMax global with a RoPE window; the
# prompt and the generated tokens run past the window, through the library's cache
LAYER_PATTERNS = {"rnope_swa": dict(pe="rope", layer_pattern="rope@8 nope@full"),
                  "bam_ssmax_global": dict(pe="rope", layer_pattern="rope@8 bam+ssmax@full")}


@pytest.mark.parametrize("name", list(LAYER_PATTERNS))
def test_a_layer_pattern_is_exported(name, tmp_path):
    model, out = export_case(tmp_path, name, **LAYER_PATTERNS[name])
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert hf_model.config.bam_model["layer_pattern"] == LAYER_PATTERNS[name]["layer_pattern"]
    assert_same_model(model, hf_model)


@pytest.mark.parametrize("name", [name for name, kw in CASES.items() if kw["ssmax"]])
def test_loaded_in_bf16_the_priors_and_ssmax_stay_fp32(name, exported):
    """torch_dtype=torch.bfloat16, the usual way to load: the weights go bf16, the positional priors and SSMax's
    scales stay fp32 (in bf16 BAM's shape alone moves a logit at distance 0 by up to 3.6), and the logits stay
    within bf16's rounding of the fp32 export's."""
    model, out = exported[name]
    fp32 = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).eval()
    kept = {id(p) for p in bf16.model.prior_parameters()}
    assert kept and all(p.dtype == torch.float32 for p in bf16.model.prior_parameters())
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters() if id(p) not in kept)
    x, _ = batch(T=24, vocab=GPT2_VOCAB)
    with torch.no_grad():
        want, got = fp32(x).logits, bf16(x).logits.float()
    assert relative_error(got, want, norm="max") < 0.05


def test_fox_gate_init_bias_is_exported(tmp_path):
    """A setting that only initialises (the gates' starting bias) still travels: checkpoint -> export's
    bam_model -> the loaded model's config, next to the trained bias in the weights."""
    model, out = export_case(tmp_path, "fox_ssmax_open", pe="fox", ssmax=True, fox_gate_init_bias=5.0)
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert hf_model.config.bam_model["fox_gate_init_bias"] == 5.0
    assert hf_model.config.bam_model == {k: getattr(model.config, k) for k in CONFIG_FIELDS}
    assert_same_model(model, hf_model)

def test_the_cache_and_right_padding_give_the_full_forward_logits(exported):
    model, out = exported["bam_ssmax"]
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    x, _ = batch(T=12, vocab=GPT2_VOCAB)
    with torch.no_grad():
        full = hf_model(x, use_cache=False).logits
        first = hf_model(x[:, :8], use_cache=True)
        rest = hf_model(x[:, 8:], use_cache=True, **{CACHE: getattr(first, CACHE)}).logits
        torch.testing.assert_close(torch.cat([first.logits, rest], 1), full, rtol=1e-5, atol=1e-5)
        padded = torch.cat([x, torch.full((2, 3), EOT)], 1)
        mask = torch.cat([torch.ones(2, 12), torch.zeros(2, 3)], 1).long()
        torch.testing.assert_close(hf_model(padded, attention_mask=mask).logits[:, :12], full, rtol=1e-5, atol=1e-5)
        left = mask.flip(1)
        with pytest.raises(ValueError, match="left padding"):
            hf_model(padded, attention_mask=left)
        labels = x.clone()
        labels[:, :3] = -100
        loss = hf_model(x, labels=labels).loss
        want = torch.nn.functional.cross_entropy(full[:, 2:-1].flatten(0, 1), x[:, 3:].flatten())
        torch.testing.assert_close(loss, want)


def test_lm_eval_hf_model_on_the_folder_scores_as_eval_downstream(exported):
    """lm-eval's own `hf` model loading the exported folder, and eval.downstream's ProjectLM on the project's
    model: two independent paths from text to log-likelihood that must agree."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from eval import downstream
    from eval.loading import autocast

    model, out = exported["bam_ssmax"]
    pairs = [("The quick brown fox", " jumps"), ("Hello there, my", " dear friend of old"), ("", "Hello world"),
             ("Question: what is 2 + 2?\nAnswer:", " 4")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    hf_lm = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=2, device="cpu")
    ours = downstream.make_project_lm(model, load_tokenizer("gpt2"), 64, 2, autocast(torch.device("cpu"), torch.float32))
    for (a, greedy_a), (b, greedy_b) in zip(hf_lm.loglikelihood(requests), ours.loglikelihood(requests)):
        assert a == pytest.approx(b, rel=1e-5) and greedy_a == greedy_b


def test_tokenizer_gives_the_project_ids(exported):
    _, out = exported["bam"]
    want = gpt2_encoding().encode(TEXT, allowed_special={"<|endoftext|>"})
    assert EOT in want and len(want) > 80
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok(TEXT)["input_ids"] == want
    assert tok.decode(want) == TEXT
    assert tok.eos_token_id == EOT and tok.pad_token_id == EOT


def test_folder_loads_without_the_repository(exported, tmp_path):
    """A clean interpreter in another folder, repository off sys.path: what a user of the folder has."""
    model, out = exported["bam_ssmax"]
    x, _ = batch(T=24, vocab=GPT2_VOCAB)
    with torch.no_grad():
        want, _ = model(x)
    torch.save({"x": x, "logits": want}, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import importlib.util, sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        assert importlib.util.find_spec("model") is None and importlib.util.find_spec("export_hf") is None
        want = torch.load({str(tmp_path / 'want.pt')!r})
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            got = m(want["x"]).logits
        assert ((got - want["logits"]).abs().max() / want["logits"].abs().max()).item() < 1e-5
        tok = AutoTokenizer.from_pretrained({str(out)!r})  # no trust_remote_code: the tokenizer needs none
        print("ids", tok("Hello world<|endoftext|>")["input_ids"])
        """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ids [15496, 995, {EOT}]" in done.stdout


def export_error(capsys, *args):
    """The command line must exit non-zero with one line starting with 'error:'."""
    with pytest.raises(SystemExit) as e:
        export_hf.run_cli(export_hf.main, [str(a) for a in args])
    assert e.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_inputs_are_one_clear_line_and_keep_existing_output(tmp_path, exported, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert "no checkpoint" in export_error(capsys, tmp_path / "run", tmp_path / "out")
    assert "no checkpoint file or run directory" in export_error(capsys, tmp_path / "nothing", tmp_path / "out")
    model = exported_model()
    ckpt = {"model_config": {**vars(model.config), "pe": "fourier"}, "model": model.state_dict()}
    torch.save(ckpt, tmp_path / "foreign.pt")
    assert "unknown pe 'fourier'" in export_error(capsys, tmp_path / "foreign.pt", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    _, out = exported["rope"]
    before = sorted(os.listdir(out))
    with pytest.raises(export_hf.ExportError, match="already exists"):
        export_hf.export(str(tmp_path / "foreign.pt"), str(out))
    assert sorted(os.listdir(out)) == before
    assert not [p for p in os.listdir(out.parent) if p.startswith(".")]  # no temporary folder left behind
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert "is not a folder export_hf.py wrote" in export_error(capsys, tmp_path / "foreign.pt", precious, "--overwrite")
    assert (precious / "notes.txt").read_text() == "keep me"


def test_overwrite_replaces_an_earlier_export(tmp_path):
    """exported.json lists every file the export wrote; an export missing one of them (deleted by the user) is
    still an earlier export, and is replaced whole."""
    first, out = export_case(tmp_path, "again", pe="alibi", ssmax=True)
    manifest = json.loads((out / "exported.json").read_text())
    assert manifest["written_by"] == "export_hf.py"
    assert sorted(f.rstrip("/") for f in manifest["files"]) == sorted(set(snapshot(out)) - {"exported.json"})
    (out / "generation_config.json").unlink()
    save_model(exported_model(seed=5, pe="bam"), str(tmp_path / "second.pt"))
    export_hf.main([str(tmp_path / "second.pt"), str(out), "--overwrite"])
    hf_model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert hf_model.config.bam_model["pe"] == "bam"
    assert (out / "generation_config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "again.pt", "second.pt"]


def test_overwrite_replaces_only_an_export_holding_nothing_else(tmp_path, capsys):
    """A checkout of this repository (modeling_bam.py at its root, as an export has) with the user's notes; an
    earlier export the user added notes and results to; an export of the version before exported.json, which
    nothing can tell apart from one the user added to: each refused in one line (the first naming the file it
    lacks, the second what was added), not a byte of the folder changed, nothing written beside it."""
    save_model(exported_model(), str(tmp_path / "model.pt"))
    checkout = tmp_path / "checkout"
    before = checkout_like(checkout)
    line = export_error(capsys, tmp_path / "model.pt", checkout, "--overwrite")
    assert f"OUT_DIR {checkout} is not a folder export_hf.py wrote (no exported.json of it)" in line, line
    assert snapshot(checkout) == before

    _, out = export_case(tmp_path, "earlier", pe="rope")
    (out / NOTES).write_text("the export I uploaded")
    (out / "eval").mkdir()
    (out / "eval" / "passkey.json").write_text("{}")
    before = snapshot(out)
    capsys.readouterr()  # the export's progress bars
    line = export_error(capsys, tmp_path / "model.pt", out, "--overwrite")
    assert f"OUT_DIR {out} holds what export_hf.py did not write: eval/, {NOTES};" in line, line
    assert snapshot(out) == before

    (out / NOTES).unlink()
    shutil.rmtree(out / "eval")
    (out / "exported.json").unlink()  # as the export_hf.py before it wrote one
    before = snapshot(out)
    line = export_error(capsys, tmp_path / "model.pt", out, "--overwrite")
    assert "looks like the output of an earlier export_hf.py, which did not list the files it wrote" in line, line
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkout", "earlier", "earlier.pt", "model.pt"]


def files_under(folder):
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


def test_an_out_dir_that_holds_or_lies_in_the_source_is_refused_with_nothing_written(tmp_path, capsys):
    """A checkpoint kept inside an earlier export: --overwrite would swap out the folder and the checkpoint with it.
    An OUT_DIR inside the run it exports would be written into the run. One line naming both, nothing changed."""
    _, out = export_case(tmp_path, "hf", pe="rope")
    shutil.copy(tmp_path / "hf.pt", out / "mine.pt")
    run = tmp_path / "run"
    save_model(exported_model(), str(run / "checkpoints" / "step_00000001.pt"))
    for args, words in (((out / "mine.pt", out, "--overwrite"), f"OUT_DIR {out} contains RUN_OR_CHECKPOINT {out}/"),
                        ((run, run / "hf"), f"OUT_DIR {run}/hf lies inside RUN_OR_CHECKPOINT {run}")):
        before = files_under(tmp_path)
        capsys.readouterr()
        line = export_error(capsys, *args)
        assert words in line and "lie apart" in line, line
        assert files_under(tmp_path) == before and not (run / "hf").exists()


def test_model_py_must_be_self_contained(tmp_path):
    export_hf.check_self_contained(os.path.join(REPO, "model.py"))
    bad = tmp_path / "model.py"
    bad.write_text("import torch\nimport os.path\nfrom data import EOT\n")
    with pytest.raises(export_hf.ExportError, match="imports data"):
        export_hf.check_self_contained(str(bad))


class Killed(BaseException):
    """A kill between two steps of the folder swap: nothing in export() catches it."""


@pytest.mark.parametrize("point", ["complete", "journal", "exchanged"])
def test_an_overwrite_killed_mid_swap_is_finished_by_the_next_export(tmp_path, monkeypatch, capsys, point):
    """After a kill the folder is a whole export; the next export cleans up and leaves only its own folder."""
    from bam import outputs

    first, out = export_case(tmp_path, "swap", pe="rope")
    save_model(exported_model(seed=5, pe="alibi"), str(tmp_path / "second.pt"))

    def kill(where):
        if where == point:
            raise Killed(where)

    monkeypatch.setattr(outputs, "_fault", kill)
    with pytest.raises(Killed):
        export_hf.export(str(tmp_path / "second.pt"), str(out), overwrite=True)
    monkeypatch.setattr(outputs, "_fault", lambda where: None)
    pe = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).config.bam_model["pe"]
    assert pe in ("rope", "alibi")  # one whole export at every moment
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith(".swap.")]
    assert leftovers  # what the killed run left, for the next one to finish

    export_hf.export(str(tmp_path / "second.pt"), str(out), overwrite=True)
    assert "a killed export was cleaned up" in capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).config.bam_model["pe"] == "alibi"
    assert sorted(os.listdir(tmp_path)) == ["second.pt", "swap", "swap.pt"]


def test_an_export_follows_the_umask(tmp_path):
    old = os.umask(0o002)  # a group-shared model folder on a cluster
    try:
        _, out = export_case(tmp_path, "shared", pe="nope")
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o775
    assert {name: os.stat(out / name).st_mode & 0o777 for name in os.listdir(out)} == \
        dict.fromkeys(os.listdir(out), 0o664)


@pytest.mark.parametrize("limit", ["file size", "full disk"])
def test_a_write_that_fails_mid_export_is_one_line_and_the_earlier_export_stays(tmp_path, limit):
    """safetensors raises its own error for a failed write ("I/O error: File too large (os error 27)"): the
    export says it in the one line the .pt checkpoints give, and the earlier export is whole."""
    first, out = export_case(tmp_path, "earlier", pe="rope")
    before = {p: open(os.path.join(out, p), "rb").read() for p in sorted(os.listdir(out))}
    save_model(exported_model(seed=5, pe="alibi"), str(tmp_path / "big.pt"))  # 13 MB of embeddings, as the earlier one
    if limit == "file size":  # ulimit -f 2048 (in 512-byte blocks: 1 MiB)
        def set_limit():
            import resource
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        target, preexec = out, set_limit
    else:  # a small file system of its own: the export is written beside its target, so onto it
        mount = tmp_path / "small_fs"
        mount.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)],
                          capture_output=True).returncode != 0:
            pytest.skip("no tmpfs mount here (needs root)")
        target, preexec = mount / "earlier", None
    try:
        if limit == "full disk":
            shutil.copytree(out, target)
        done = subprocess.run([sys.executable, "export_hf.py", str(tmp_path / "big.pt"), str(target), "--overwrite"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, preexec_fn=preexec)
        reason = "the file is too large" if limit == "file size" else "the disk is full"
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]  # transformers' bar aside
        assert done.returncode == 1 and errors == [done.stderr.strip().splitlines()[-1]], done.stderr[-3000:]
        assert errors[0].startswith(f"error: cannot write {target}: {reason}") \
            and errors[0].endswith("; the previous export is intact"), done.stderr
        assert {p: open(os.path.join(target, p), "rb").read() for p in sorted(os.listdir(target))} == before
        assert not [p for p in os.listdir(os.path.dirname(target)) if p.startswith(".earlier.")]
    finally:
        if limit == "full disk":
            subprocess.run(["umount", str(mount)], capture_output=True)
