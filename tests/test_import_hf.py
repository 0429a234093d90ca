"""import_hf.py: small random models of each Llama-family architecture, built and saved by transformers itself
with a tokenizer trained here (no Hub), imported as run directories whose model computes what transformers
computes on every attention path (fp32 logits, greedy tokens, a KV-cache decode), exported back by export_hf.py
to the same logits, and refused in one line where model.py cannot honour a setting. One test takes an import
through the evaluators, a fine-tune with SSMax added (train.init_from) and the export; another a Qwen3 import
through the evaluators to transformers' greedy text. Qwen3-0.6B's and 1.7B's published configs are checked on
the meta device, and 0.6B's widths imported from the format of a download (sharded bf16 safetensors)."""

import json
import os
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, SmolLM3Config,
                          SmolLM3ForCausalLM)
from transformers.modeling_outputs import CausalLMOutputWithPast

import export_hf
import import_hf
import prepare_fineweb
import sample
import train
from bam.checkpoint import load_checkpoint, load_model, step_checkpoints
from bam.cli import run_cli
from bam.config import load_config
from local_tokenizers import bpe_folder, training_text
from planted import NOTES, checkout_like, snapshot
from tiny_models import relative_error
from model import KVCache, ModelConfig

pytestmark = pytest.mark.slow  # transformers models imported, evaluated, fine-tuned and exported again

# transformers' name for the KV cache, as argument and in the output: 5.17's `past_key_values`, 5.24's `cache`
# (modeling_bam.py reads it the same way)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

VOCAB = 320  # the tokenizer's 300 tokens and its BOS and EOS (300, 301), padded as published models pad theirs
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-5,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "smollm3": (SmolLM3Config, SmolLM3ForCausalLM)}
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64, rope_theta=500_000.0)
CASES = {  # name: (family, config, what the import must make of it)
    # SmolLM's shape; the end-to-end test's model, whose 256-token context holds a passkey prompt
    "llama_tied_gqa": ("llama", dict(tie_word_embeddings=True, max_position_embeddings=256),
                       dict(tie_embeddings=True, n_kv_head=2, block_size=256)),
    "llama_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10_000.0)),
                     dict(rope_scaling="linear", rope_factor=2.0, block_size=64)),
    # Llama 3.1's scaling (pairs kept, blended and divided over the 64-token original context), plain multi-head
    # attention, and a head width that is not hidden / heads
    "llama3_mha_head_dim": ("llama", dict(num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
                                          rope_parameters=LLAMA3, v4_layout=True),
                            dict(rope_scaling="llama3", rope_factor=8.0, block_size=64, rope_original_context=64,
                                 attn_head_dim=32, n_kv_head=0)),
    "mistral_window": ("mistral", dict(sliding_window=8, v4_layout=True), dict(attn_window=8)),
    "qwen2_bias_tied": ("qwen2", dict(tie_word_embeddings=True), dict(qkv_bias=True, tie_embeddings=True)),
    # Gemma 4's partial RoPE (transformers' "proportional" rope type, p-RoPE): a quarter of the 8 pairs turn, the
    # frequencies divided by its factor
    "llama_p_rope": ("llama", dict(rope_parameters=dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                        factor=2.0, rope_theta=10_000.0)),
                     dict(rope_fraction=0.25, rope_scaling="linear", rope_factor=2.0)),
    # SmolLM3 as published: NoPE every 4th layer (no_rope_layers), full attention, tied embeddings
    "smollm3_nope": ("smollm3", dict(num_hidden_layers=8), dict(layer_pattern="rope*3 nope", attn_window=0,
                                                                 tie_embeddings=True)),
    # SmolLM3's windows by layer_types, here on a RoPE and the NoPE layer; the window of 8 < the tests' lengths
    "smollm3_windows": ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "full_attention",
                                                     "sliding_attention"]),
                        dict(layer_pattern="rope@8 rope@full*2 nope@8", attn_window=0)),
    # Qwen2's use_sliding_window: the layers from max_window_layers on have the window
    "qwen2_max_window_layers": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
                                              max_window_layers=2),
                                dict(layer_pattern="rope@full*2 rope@8*2", attn_window=0, qkv_bias=True)),
    # Qwen3 as published: QK-norm (its gains moved off 1 as every norm here), no biases, tied embeddings, a head
    # width that is not hidden / heads (16 x 4 heads from 32 wide, as Qwen3-0.6B's 128 x 16 from 1024: the flex
    # kernels of the first case); 256 positions for the evaluators' prompts
    "qwen3_qk_norm": ("qwen3", dict(hidden_size=32, head_dim=16, tie_word_embeddings=True,
                                    max_position_embeddings=256),
                      dict(qk_norm=True, qkv_bias=False, attn_head_dim=16, n_embd=32, n_kv_head=2,
                           tie_embeddings=True, block_size=256)),
    # Qwen3's windows by layer_types, with lm_head a weight of its own
    "qwen3_windows": ("qwen3", dict(num_hidden_layers=4, head_dim=16, use_sliding_window=True, sliding_window=8,
                                    layer_types=["full_attention", "sliding_attention"] * 2),
                      dict(qk_norm=True, layer_pattern="rope@full rope@8", attn_window=0, tie_embeddings=False)),
}
PATHS = ("eager", "sdpa", "flex")
# flex compiles one kernel per shape on a CPU (10-20 s each): every case shares the first one's (GQA, head width
# 16) but this one, whose other shapes (multi-head, head width 32) run on eager and sdpa only
NO_FLEX = {"llama3_mha_head_dim"}
MEASURED = {}  # (case, path) -> max relative logit difference, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_folder(str(tmp_path_factory.mktemp("tok") / "bpe"), vocab_size=300)


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """As Qwen's tokenizers are: no BOS, <|endoftext|> after each document."""
    return bpe_folder(str(tmp_path_factory.mktemp("tok") / "qwen"), vocab_size=300, bos=None, eos="<|endoftext|>")


def hf_folder(folder, family, tokenizer=None, seed=0, v4_layout=False, **config):
    """A random model of `family` saved as transformers saves it, with norms and biases moved off their init
    (1 and 0), so that a weight imported to the wrong place cannot go unnoticed; the tokenizer's files beside.
    `v4_layout`: config.json as transformers 4 wrote it and published models have it (rope_theta at the top,
    the scaling as rope_scaling)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **config}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    if v4_layout:
        raw = json.loads((folder / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        (folder / "config.json").write_text(json.dumps(raw))
    for name in os.listdir(tokenizer) if tokenizer else ():
        shutil.copy(os.path.join(tokenizer, name), folder)
    return model, str(folder)


@pytest.fixture(scope="module")
def imported(tokenizer, qwen_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    made = {}
    for name, (family, config, _) in CASES.items():
        model, src = hf_folder(root / f"{name}_hf", family, qwen_tokenizer if family == "qwen3" else tokenizer,
                               **config)
        out = str(root / name)
        import_hf.main([src, out])
        made[name] = (model, src, out)
    yield made
    print("\nmax relative logit difference, imported vs transformers (fp32):")
    for (name, path), value in sorted(MEASURED.items()):
        print(f"  {name:18s} {path:9s} {value:.2e}")


def tokens(batch=2, length=24, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,path", [(n, p) for n in CASES for p in PATHS if not (p == "flex" and n in NO_FLEX)])
def test_imported_logits_equal_transformers_on_every_attention_path(name, path, imported):
    hf_model, _, out = imported[name]
    ours = load_model(out, attn_impl=path).eval()
    for key, value in CASES[name][2].items():
        assert getattr(ours.config, key) == value, key
    if ours.config.tie_embeddings:
        assert ours.lm_head.weight is ours.tok_emb.weight
    hf_model.set_attn_implementation("sdpa" if path == "sdpa" else "eager")  # flex: against the eager reference
    x = tokens()
    with torch.no_grad():
        want, got = hf_model(x).logits, ours(x)[0]
    MEASURED[name, path] = relative_error(got, want, norm="max")
    assert MEASURED[name, path] < 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_a_kv_cache_decode_equal_transformers(name, imported):
    hf_model, _, out = imported[name]
    hf_model.set_attn_implementation("eager")
    ours = load_model(out).eval()
    prompt = tokens(1, 7, seed=2)
    want = hf_model.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 20, temperature=0), want)
    x = tokens(2, 21, seed=3)  # 20 cached positions (past Mistral's window of 8), then one decoded
    with torch.no_grad():
        first = hf_model(x[:, :20], use_cache=True)
        want = hf_model(x[:, 20:], use_cache=True, **{CACHE: getattr(first, CACHE)}).logits
        cache = KVCache(ours.config, 2, 21, "cpu", torch.float32)
        ours(x[:, :20], kv_cache=cache)
        got = ours(x[:, 20:], kv_cache=cache, start_pos=20)[0]
    assert relative_error(got, want, norm="max") < 1e-5


def test_the_scalings_and_the_window_change_the_logits_here(imported):
    """The cases reach what they test: without its llama3 or linear scaling, its window or its pattern, or with a
    window of one key more or less (the tests' 24 tokens are past the window of 8), the model differs."""
    x = tokens()
    for name, setting in (("llama3_mha_head_dim", dict(rope_scaling="none", rope_factor=1.0)),
                          ("llama_linear", dict(rope_scaling="none", rope_factor=1.0)),
                          ("llama_p_rope", dict(rope_fraction=1.0)),
                          ("mistral_window", dict(attn_window=0)),
                          ("smollm3_nope", dict(layer_pattern="")),
                          ("smollm3_windows", dict(layer_pattern="rope@9 rope@full*2 nope@9")),  # W + 1 keys
                          ("smollm3_windows", dict(layer_pattern="rope@8 rope@full*2 rope@8")),
                          ("qwen2_max_window_layers", dict(layer_pattern="rope@full*2 rope@7*2")),  # W - 1 keys
                          ("qwen2_max_window_layers", dict(layer_pattern="rope@full*2 rope@9*2")),
                          ("qwen3_windows", dict(layer_pattern="rope@full rope@7")),
                          ("qwen3_windows", dict(layer_pattern="rope@full rope@9"))):
        hf_model, _, out = imported[name]
        with torch.no_grad():
            wrong = load_model(out, **setting).eval()(x)[0]
            assert relative_error(wrong, hf_model(x).logits, norm="max") > 1e-3, name


@pytest.mark.parametrize("name", list(CASES))
def test_export_of_an_import_gives_the_original_logits_in_transformers(name, imported, tmp_path):
    hf_model, _, out = imported[name]
    hf_model.set_attn_implementation("eager")
    export_hf.export(out, str(tmp_path / "hf"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    x = tokens()
    with torch.no_grad():
        assert relative_error(back(x).logits, hf_model(x).logits, norm="max") < 1e-5


def test_the_run_directory_is_like_any_other(imported, tokenizer):
    _, src, out = imported["llama_tied_gqa"]
    path, ckpt = load_checkpoint(out)
    assert [os.path.basename(p) for p in step_checkpoints(out)] == ["step_00000000.pt"] and ckpt["step"] == 0
    config = load_config(os.path.join(out, "config.toml"))
    assert config.data.tokenizer == os.path.join(out, "tokenizer") == ckpt["tokenizer"]["name"]
    assert ckpt["config"]["data"]["tokenizer"] == config.data.tokenizer
    assert config.log.out_dir == out + "_tuned" and config.model == load_model(out).config
    from bam.tokenizer import load_tokenizer
    assert ckpt["tokenizer"]["sha256"] == load_tokenizer(tokenizer).identity.sha256  # the copy is the same tokenizer
    assert json.load(open(os.path.join(out, "imported.json")))["source"] == src


def refusal(tmp_path, capsys, src):
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run_cli(import_hf.main, [str(src), str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()
    return err


def config_folder(folder, family, architecture=None, **config):
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(**{**BASE, **config})
    cfg.architectures = [architecture or model_cls.__name__]
    cfg.save_pretrained(folder)
    return folder


REFUSED = {  # name: (family, config, the words of the one line)
    "gelu": ("llama", dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    "o_proj_bias": ("llama", dict(attention_bias=True), "attention_bias = True"),
    # Qwen3's attention_bias puts a bias on o_proj too (Qwen2's q, k, v biases have none there)
    "qwen3_o_proj_bias": ("qwen3", dict(attention_bias=True), "attention_bias = True"),
    "mlp_bias": ("llama", dict(mlp_bias=True), "mlp_bias = True"),
    "yarn": ("llama", dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10_000.0)),
             "rope_parameters.rope_type = 'yarn'"),
    # transformers' Llama ignores the factor under the default rope type (and fails under linear): not imported
    "partial_default": ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=10_000.0,
                                                           partial_rotary_factor=0.5)), "partial_rotary_factor = 0.5"),
    # layer_types names sliding layers, but without use_sliding_window Qwen2 has no window for them
    "qwen2_types_no_window": ("qwen2", dict(layer_types=["sliding_attention", "full_attention"]),
                              "sliding_window = None"),
    # SmolLM3 keeps the window then: its mask would slide, its flash attention not
    "smollm3_types_no_sliding": ("smollm3", dict(num_hidden_layers=2, sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"]),
                                 "use_sliding_window = False"),
    "chunked_layer": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                    layer_types=["chunked_attention", "full_attention"]),
                      "layer_types = 'chunked_attention'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_setting_model_py_cannot_honour_is_one_line_naming_it(name, tmp_path, capsys):
    family, config, words = REFUSED[name]
    err = refusal(tmp_path, capsys, config_folder(tmp_path / "src", family, **config))
    assert words in err, err


def test_an_error_of_transformers_keeps_its_reason_in_one_line(tmp_path, capsys):
    """layer_types shorter than the layers or naming an unknown type: the import's own check runs before
    transformers (whose first line names only its validator, the reason on the next) and says it as every other
    refusal does. What only transformers refuses keeps its reason, its lines joined into one."""
    src = config_folder(tmp_path / "src", "qwen2", num_hidden_layers=2)
    raw = json.loads((src / "config.json").read_text())

    def refused_with(**changes):
        (src / "config.json").write_text(json.dumps({**raw, **changes}))
        return refusal(tmp_path, capsys, src)

    err = refused_with(num_hidden_layers=4, layer_types=["full_attention"] * 2)
    assert "layer_types = ['full_attention', 'full_attention']: it names 2 layers of 4 (num_hidden_layers)" in err, err
    assert "layer_types = 'sliding_window'" in refused_with(layer_types=["full_attention", "sliding_window"])
    err = refused_with(layer_types="full_attention")  # not a list: transformers' two lines, the reason kept
    assert "transformers cannot read" in err and "Validation error for field 'layer_types': TypeError: Field " \
        "'layer_types' with value 'full_attention' doesn't match any type" in err, err
    err = refused_with(num_hidden_layers="2")
    assert "Field 'num_hidden_layers' expected int, got str" in err, err
    err = refused_with(rope_parameters=dict(rope_type="linear", rope_theta=10_000.0))  # a KeyError: no quotes
    assert "transformers cannot read" in err and ": Missing required keys in `rope_parameters`" in err, err


LAYER_SETTINGS = [  # (family, config, attn_window, layer_pattern): what transformers' config makes of each layer
    ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=0), 8, ""),
    ("qwen2", dict(num_hidden_layers=4, sliding_window=8, max_window_layers=2), 0, ""),  # use_sliding_window off
    ("qwen2", dict(num_hidden_layers=6, use_sliding_window=True, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"] * 3), 0, "rope@8 rope@full"),
    ("qwen3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2), 0,
     "rope@full*2 rope@8*2"),
    ("qwen3", dict(num_hidden_layers=4, sliding_window=4096, max_window_layers=2), 0, ""),  # as published
    # SmolLM3's use_sliding_window windows its NoPE layers
    ("smollm3", dict(num_hidden_layers=8, use_sliding_window=True, sliding_window=8), 0, "rope@full*3 nope@8"),
    ("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 1]), 0, ""),
    ("smollm3", dict(num_hidden_layers=4, no_rope_layers=[0, 0, 0, 0]), 0, "nope"),
    ("smollm3", dict(num_hidden_layers=6, no_rope_layer_interval=3), 0, "rope*2 nope"),
]


@pytest.mark.parametrize("family,config,window,pattern", LAYER_SETTINGS)
def test_per_layer_settings_become_the_shortest_pattern(family, config, window, pattern, tmp_path):
    src = config_folder(tmp_path / "src", family, **config)
    arch, hf, _ = import_hf.read_hf_config(str(src))
    cfg = import_hf.model_config(arch, hf, "config.json")
    assert (cfg.attn_window, cfg.layer_pattern) == (window, pattern)


def test_another_architecture_remote_code_and_a_foreign_weight_are_one_line(tmp_path, capsys, tokenizer):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert "architectures = ['GPT2LMHeadModel']: import_hf.py takes one of LlamaForCausalLM" in \
        refusal(tmp_path, capsys, gpt2)
    remote = config_folder(tmp_path / "remote", "llama")
    raw = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**raw, "auto_map": {"AutoModelForCausalLM": "x.Model"}}))
    err = refusal(tmp_path, capsys, remote)
    assert "auto_map" in err and "trust_remote_code" in err, err
    from safetensors.torch import load_file, save_file
    _, src = hf_folder(tmp_path / "biased", "llama", tokenizer)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.0.self_attn.o_proj.bias has no place in model.py" in refusal(tmp_path, capsys, src)
    bare = tmp_path / "no_tokenizer"  # a new folder: load_tokenizer keeps what it loaded by name
    _, src = hf_folder(bare, "llama")
    assert "tokenizer" in refusal(tmp_path, capsys, src)


def test_an_out_that_is_holds_or_lies_in_src_is_refused_with_nothing_written(tmp_path, capsys, tokenizer):
    """The source downloaded into an earlier import (`OUT/model OUT --overwrite`: the swap would replace OUT and the
    source with it), OUT inside SRC (the run would be written into the model folder), the two the same, and the
    first through a link: one line naming both, exit 1, not a byte changed or added anywhere."""
    _, first = hf_folder(tmp_path / "download", "llama", tokenizer)
    out = str(tmp_path / "OUT")
    import_hf.main([first, out])
    shutil.copytree(first, os.path.join(out, "model"))
    src = str(tmp_path / "SRC")
    shutil.copytree(first, src)
    os.symlink(out, tmp_path / "link")
    cases = [([os.path.join(out, "model"), out, "--overwrite"], f"OUT {out} contains SRC {out}/model"),
             ([src, os.path.join(src, "run")], f"OUT {src}/run lies inside SRC {src}"),
             ([src, src, "--overwrite"], f"OUT {src} is SRC {src}"),
             ([str(tmp_path / "link" / "model"), out, "--overwrite"],
              f"OUT {out} contains SRC {tmp_path}/link/model (resolved: OUT {out}, SRC {out}/model)")]
    for args, words in cases:
        before = snapshot(tmp_path)
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            run_cli(import_hf.main, args)
        err = capsys.readouterr().err
        assert info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
        assert words in err and "lie apart" in err, err
        assert snapshot(tmp_path) == before, args


def import_refusal(capsys, *args):
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run_cli(import_hf.main, [str(a) for a in args])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_overwrite_replaces_only_an_import_holding_nothing_else(tmp_path, capsys, tokenizer):
    """A checkout of this repository with the user's notes, an earlier import holding an evaluation's results and
    notes, an import of the version before imported.json listed its files: each refused in one line, not a byte
    changed; an earlier import holding nothing else is replaced, also one the user deleted a file of."""
    _, src = hf_folder(tmp_path / "download", "llama", tokenizer)
    checkout = tmp_path / "checkout"
    before = checkout_like(checkout)
    err = import_refusal(capsys, src, checkout, "--overwrite")
    assert f"OUT {checkout} is not a folder import_hf.py wrote (no imported.json of it)" in err, err
    assert snapshot(checkout) == before

    out = tmp_path / "OUT"
    import_hf.main([src, str(out)])
    manifest = json.loads((out / "imported.json").read_text())
    assert manifest["written_by"] == "import_hf.py" and manifest["source"] == src
    assert sorted(f.rstrip("/") for f in manifest["files"]) == sorted(set(snapshot(out)) - {"imported.json"})
    (out / NOTES).write_text("passkey at 4x looked odd")
    (out / "eval").mkdir()
    (out / "eval" / "passkey.json").write_text("{}")
    before = snapshot(out)
    err = import_refusal(capsys, src, out, "--overwrite")
    assert f"OUT {out} holds what import_hf.py did not write: eval/, {NOTES};" in err, err
    assert snapshot(out) == before

    (out / NOTES).unlink()
    shutil.rmtree(out / "eval")
    marker = (out / "imported.json").read_text()
    (out / "imported.json").write_text(json.dumps({k: manifest[k] for k in ("source", "architecture", "hf_config")}))
    before = snapshot(out)
    err = import_refusal(capsys, src, out, "--overwrite")
    assert "looks like the output of an earlier import_hf.py, which did not list the files it wrote" in err, err
    assert snapshot(out) == before

    (out / "imported.json").write_text(marker)
    (out / "config.toml").unlink()
    import_hf.main([src, str(out), "--overwrite"])
    assert (out / "config.toml").is_file() and load_checkpoint(str(out))[1]["step"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["OUT", "checkout", "download"]


def run_the_evaluators(out, tmp_path, capsys):
    """eval.passkey, eval.attention, eval.niah, eval.perplexity and sample.py on an imported run of a 256-token
    context, with its own tokenizer and context; returns the shards of its tokenizer that niah and perplexity
    read."""
    from eval.attention import evaluate_attention
    from eval.niah import evaluate_niah
    from eval.options import EvalOptions
    from eval.passkey import evaluate_passkey
    from eval.perplexity import evaluate_perplexity

    options = EvalOptions(out=str(tmp_path / "eval"), verbose=False, progress=False, device="cpu")
    passkey = evaluate_passkey(out, options=options, lengths=[256, 512], samples=2)
    assert [(r["length"], r["factor"]) for r in passkey["results"]] == [(256, 1.0), (512, 2.0)]  # 1x = its context
    assert passkey["model"]["tokenizer"] == os.path.join(out, "tokenizer")
    attention = evaluate_attention(out, options=options, prompts="passkey", lengths=[256], samples=1, queries=4)
    assert attention["results"][0]["length"] == 256

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in training_text(60) if t.strip()))
    shards = str(tmp_path / "shards")
    prepare_fineweb.main(["--source", "local", "--input", str(docs), "--out_dir", shards, "--shard_size", "4096",
                          "--workers", "1", "--tokenizer", os.path.join(out, "tokenizer")])
    niah = evaluate_niah(out, options=options, lengths=[256], samples=1, tasks=["single_number"], data_dir=shards)
    assert niah["results"] and niah["results"][0]["factor"] == 1.0
    perplexity = evaluate_perplexity(out, options=options, length="2x", window="1x", num_seqs=1, data_dir=shards)
    assert perplexity["settings"]["block_size"] == 256
    capsys.readouterr()
    sample.main([out, "--prompt", "The", "--max_new_tokens", "4", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("The")
    return shards


def test_import_evaluate_fine_tune_with_ssmax_and_export(imported, tmp_path, capsys):
    """The whole road: an imported model through the evaluators and sample.py, fine-tuned by train.py from its
    own config.toml with SSMax added (new parameters from the config's init), exported, loaded in transformers."""
    _, _, out = imported["llama_tied_gqa"]
    shards = run_the_evaluators(out, tmp_path, capsys)
    config = os.path.join(out, "config.toml")
    short = [f"--data.data_dir={shards}", "--train.max_steps=2", "--train.compile=false", "--train.dtype=float32",
             "--train.val_tokens=256", "--log.log_every=1"]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the import is weights only: nothing to resume
        train.main([config, "--resume", *short])
    assert "holds weights only" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # dropping RoPE, which the weights were trained with, needs the flag
        train.main([config, f"--train.init_from={out}", "--model.pe=bam", *short])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pe = 'rope'" in err and "--train.init_change_pe=true" in err, err
    train.main([config, f"--train.init_from={out}", "--model.ssmax=true", *short])
    printed = capsys.readouterr().out
    assert "changed: model.ssmax: False -> True" in printed
    assert "start from this config's initialisation: blocks.*.attn.ssmax_scale (2 tensors)" in printed
    tuned = out + "_tuned"
    assert [os.path.basename(p) for p in step_checkpoints(out)] == ["step_00000000.pt"]  # the import is untouched
    model = load_model(tuned).eval()
    assert model.config.ssmax and model.config.tie_embeddings and model.lm_head.weight is model.tok_emb.weight
    before = load_checkpoint(out)[1]["model"]["blocks.0.attn.wq.weight"]
    assert not torch.equal(model.blocks[0].attn.wq.weight, before)  # it trained

    export_hf.export(tuned, str(tmp_path / "hf"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True).eval()
    x = tokens()
    with torch.no_grad():
        assert relative_error(back(x).logits, model(x)[0], norm="max") < 1e-5


def test_a_qwen3_import_through_the_evaluators_and_greedy_text_as_transformers(imported, tmp_path, capsys):
    """Qwen3 (QK-norm) with a tokenizer as Qwen's (no BOS: a document opens with <|endoftext|>) through every
    evaluator, and sample.py's greedy text equal to what transformers' tokenizer decodes from its model's greedy
    tokens after the same prompt."""
    from transformers import AutoTokenizer

    hf_model, src, out = imported["qwen3_qk_norm"]
    run_the_evaluators(out, tmp_path, capsys)
    hf_model.set_attn_implementation("eager")
    tok = AutoTokenizer.from_pretrained(src)
    assert tok.bos_token_id is None  # the case this test is for
    prompt = "The value of"
    ids = torch.tensor([[tok.eos_token_id] + tok.encode(prompt, add_special_tokens=False)])
    want = hf_model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    text = tok.decode(want[0, 1:])
    assert len(text) > len(prompt) + 4  # it generated text, not only separators
    capsys.readouterr()
    sample.main([out, "--prompt", prompt, "--max_new_tokens", "12", "--temperature", "0"])
    assert capsys.readouterr().out == text.replace("<|endoftext|>", "\n<|endoftext|>\n") + "\n"


# Qwen3-0.6B's and Qwen3-1.7B's config.json as published (written by transformers 4.51: rope_theta at the top)
QWEN3_SIZES = {"Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072),
               "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144)}


def published_qwen3(folder, size, **changes):
    raw = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 28,
           "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
           "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
           "use_cache": True, "use_sliding_window": False, "vocab_size": 151936, **QWEN3_SIZES[size], **changes}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def qwen3_settings(size, n_layer=28):
    """What the import must make of it: 1.7B's heads fill its width (16 x 128 = 2048), 0.6B's are wider than its
    1024 (attn_head_dim)."""
    width = QWEN3_SIZES[size]["hidden_size"]
    return dict(vocab_size=151936, n_layer=n_layer, n_head=16, n_kv_head=8,
                attn_head_dim=0 if width == 16 * 128 else 128, head_dim=128, qk_norm=True,
                qkv_bias=False, tie_embeddings=True, rope_theta=1e6, block_size=40960, norm_eps=1e-6, pe="rope",
                attn_window=0, layer_pattern="", n_embd=width, mlp_hidden=QWEN3_SIZES[size]["intermediate_size"])


@pytest.mark.parametrize("size", list(QWEN3_SIZES))
def test_qwen3_at_its_published_shapes_maps_every_weight(size, tmp_path):
    """All 28 layers, on the meta device (no memory): the published config.json gives model.py the model whose
    state dict is transformers' renamed, name for name and shape for shape, with as many parameters."""
    from model import Transformer

    src = published_qwen3(tmp_path / size, size)
    arch, hf, _ = import_hf.read_hf_config(str(src))
    cfg = import_hf.model_config(arch, hf, "config.json")
    for key, value in qwen3_settings(size).items():
        assert getattr(cfg, key) == value, key
    with torch.device("meta"):
        theirs, ours = Qwen3ForCausalLM(hf), Transformer(cfg)
    ours.lm_head.weight = ours.tok_emb.weight  # as import_hf.build_model ties them
    renamed = {import_hf.our_name(name): tuple(t.shape) for name, t in theirs.state_dict().items()}
    assert renamed == {name: tuple(t.shape) for name, t in ours.state_dict().items()}
    assert renamed["blocks.27.attn.q_norm.weight"] == (128,) and renamed["blocks.0.attn.wq.weight"] == \
        (16 * 128, QWEN3_SIZES[size]["hidden_size"])
    assert sum(p.numel() for p in ours.parameters()) == theirs.num_parameters()


def test_qwen3_at_its_published_widths_imports_from_sharded_bf16(tmp_path, qwen_tokenizer):
    """A download's format at Qwen3-0.6B's widths and vocabulary, one layer of its 28: random bf16 weights saved
    by transformers in shards with model.safetensors.index.json, tied embeddings (no lm_head.weight in the files).
    Imported, every weight is the file's exactly, and the logits are transformers' (fp32). About 2 GB at its
    peak and 10 s of CPU; 1.7B's widths would double both and add nothing the meta-device test above does not
    check (what differs is the width, and that its heads fill it)."""
    from safetensors.torch import load_file

    size = "Qwen3-0.6B"
    src = published_qwen3(tmp_path / size, size, num_hidden_layers=1)
    hf = Qwen3Config.from_pretrained(src)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(hf, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(src, max_shard_size="200MB")
    del model
    for name in os.listdir(qwen_tokenizer):
        shutil.copy(os.path.join(qwen_tokenizer, name), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and "lm_head.weight" not in index and not (src / "model.safetensors").exists()

    out = str(tmp_path / "run")
    import_hf.main([str(src), out])
    state = load_checkpoint(out)[1]["model"]
    for shard in sorted(set(index.values())):
        for name, tensor in load_file(str(src / shard)).items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(state[import_hf.our_name(name)], tensor.float())
    cfg = ModelConfig.from_dict(load_checkpoint(out)[1]["model_config"])
    for key, value in qwen3_settings(size, n_layer=1).items():
        assert getattr(cfg, key) == value, key
    # load_model's way, less the random initialisation it overwrites (seconds at this vocabulary)
    ours = import_hf.build_model(state, cfg).eval()

    x = torch.randint(0, 151936, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(x)[0]
        del ours, state
        theirs = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, attn_implementation="eager")
        want = theirs.eval()(x).logits
    assert relative_error(got, want, norm="max") < 1e-5
