"""model.py's attention paths compute one model: flex and sdpa against eager (the reference), in values and
sdpa's gradients (flex's on a GPU), for every encoding at its defaults and its checked settings x SSMax x documents,
per-layer patterns and issue 47's designs together; grouped-query attention; flex's block masks, partial blocks
and its refusal to train on a CPU; the KV cache's generation against recomputation; eager kept in fp32 under
autocast; every tensor of a forward made on the input's device."""

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import model as model_module
import tiny_models
from model import CHECKED_SETTINGS, ENCODINGS, PE_CHOICES, RoPE, Transformer, causal_block_mask
from tiny_models import VOCAB, batch, generated_equals_recomputed, logits_with, tiny_config, tiny_model


def settings_id(settings):
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


# Every encoding, at its defaults and at each of its checked_settings (partial RoPE), x SSMax x documents; then
# per-layer patterns (ModelConfig.layer_pattern) on the tiny models' two layers: RNoPE-SWA's RoPE window and
# NoPE full attention, BAM + SSMax global with a RoPE window, a per-layer prior with token features beside a
# shared one (one kernel, table or formula, per layer kind on flex)
# and issue 47's designs together: a pattern, partial RoPE in its RoPE layers, learned sinks, gated attention
ALL_AT_ONCE = dict(layer_pattern="rope@5 bam+ssmax@full", rope_fraction=0.5, attn_sink=True, attn_gate=True)

PATTERNS = [("rope", False, "rope@5 nope@full"), ("bam", True, "rope-ssmax@5 bam+ssmax@full"),
            ("fox", False, "fox@5 alibi+ssmax")]

GRID = [pytest.param(pe, settings, ssmax, docs, id=f"{pe}-{settings_id(settings)}-{ssmax}-{docs}")
        for pe, settings in CHECKED_SETTINGS for ssmax in (False, True) for docs in (False, True)] + \
    [pytest.param(pe, {"layer_pattern": pattern}, ssmax, docs, id=f"{pe}-{pattern}-{ssmax}-{docs}")
     for pe, ssmax, pattern in PATTERNS for docs in (False, True)] + \
    [pytest.param("bam", ALL_AT_ONCE, False, docs, id=f"bam-all-at-once-{docs}") for docs in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("pe,settings,ssmax,docs", GRID)
def test_flex_and_sdpa_outputs_match_eager(pe, settings, ssmax, docs):
    model = tiny_model(pe=pe, ssmax=ssmax, bam_train_loc=True, **settings)
    idx, doc_ids = batch()
    doc_ids = doc_ids if docs else None
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        for impl in ("sdpa", "flex"):
            torch.testing.assert_close(logits_with(model, impl, idx, doc_ids), ref, atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"{impl}: {m}")


AVX2_FLEX = """import torch
from tiny_models import batch, logits_with, tiny_model
model = tiny_model(pe='nope', block_size=128)
for T in (8, 40):
    idx, _ = batch(T=T)
    with torch.no_grad():
        torch.testing.assert_close(logits_with(model, 'flex', idx), logits_with(model, 'eager', idx), atol=2e-5,
                                   rtol=1e-4, msg=lambda m: f'T={T}: {m}')
"""


@pytest.mark.slow  # a process of its own: inductor picks the vector ISA its C++ is built for once per process
def test_flex_built_for_avx2_equals_eager_at_lengths_that_end_inside_a_block(tmp_path):
    """Inductor's AVX2 build of the CPU flex kernel (torch 2.11 to 2.15) returns wrong values when the sequence
    ends inside one of its blocks, which is why a CPU runs flex padded to whole blocks (model.flex_mask_length).
    Its AVX-512 build is right, so on an AVX-512 machine the tests above cannot see the padding go: here inductor
    is asked for AVX2's code, with a cache of its own (the kernels above were built for this machine's ISA)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"this CPU runs no AVX2 code (torch sees {torch.backends.cpu.get_cpu_capability()})")
    path = os.pathsep.join(os.path.dirname(m.__file__) for m in (model_module, tiny_models))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", AVX2_FLEX], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("pe,settings,ssmax,docs", GRID)
def test_sdpa_gradients_match_eager(pe, settings, ssmax, docs):
    # bam_train_loc so the location parameter's gradient is checked as well
    model = tiny_model(pe=pe, ssmax=ssmax, bam_train_loc=True, **settings)
    idx, doc_ids = batch(T=24)
    targets = torch.roll(idx, -1, dims=1)
    grads = {}
    for impl in ("eager", "sdpa"):
        model.zero_grad(set_to_none=True)
        model.config.attn_impl = impl
        _, loss = model(idx, targets, doc_ids=doc_ids if docs else None)
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads["eager"].keys() == grads["sdpa"].keys()
    prior_names = [n for n in grads["eager"] if n.startswith("priors") or "ssmax" in n]
    if pe == "bam" or ssmax:
        assert prior_names, "the prior/SSMax parameters must receive gradients"
    for name, g in grads["eager"].items():
        assert g.abs().sum() > 0 or name.endswith("loc"), f"{name} got no gradient"
        torch.testing.assert_close(grads["sdpa"][name], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.cuda  # flex has no backward on the CPU (torch 2.11 to 2.15)
@pytest.mark.parametrize("pe,ssmax", [("bam", True), ("alibi", False), ("rope", True), ("t5", True), ("fire", False),
                                     ("fox", True)])  # FoX, FIRE: flex differentiates through their token features
def test_flex_gradients_match_eager_on_gpu(pe, ssmax):
    # head_dim 16: CUDA's flex kernels refuse narrower heads ("NYI: embedding dimension ... at least 16")
    model = tiny_model(pe=pe, ssmax=ssmax, n_embd=64).cuda()
    assert model.blocks[0].attn.wq.out_features // model.config.n_head == 16
    idx, doc_ids = (t.cuda() for t in batch(T=256))
    grads = {}
    for impl in ("eager", "flex"):
        model.zero_grad(set_to_none=True)
        model.config.attn_impl = impl
        model(idx, torch.roll(idx, -1, 1), doc_ids=doc_ids)[1].backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, g in grads["eager"].items():
        torch.testing.assert_close(grads["flex"][name], g, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_gqa_matches_across_implementations():
    model = tiny_model(pe="bam", ssmax=True, n_kv_head=2)
    idx, doc_ids = batch()
    with torch.no_grad():
        ref = logits_with(model, "eager", idx, doc_ids)
        torch.testing.assert_close(logits_with(model, "sdpa", idx, doc_ids), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(logits_with(model, "flex", idx, doc_ids), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_flex_matches_eager_across_partial_blocks():
    model = tiny_model(pe="bam", ssmax=True)
    idx = torch.randint(0, VOCAB, (1, 300))  # two full 128-token blocks and a partial one
    with torch.no_grad():
        torch.testing.assert_close(logits_with(model, "flex", idx), logits_with(model, "eager", idx),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("T", [5, 128, 200, 300, 1000])
def test_causal_block_mask_equals_create_block_mask(T):
    direct = causal_block_mask(T, "cpu")
    reference = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cpu")
    assert torch.equal(direct.to_dense(), reference.to_dense())


def test_flex_training_on_cpu_is_a_clear_error():
    model = tiny_model(pe="bam", attn_impl="flex")
    idx, _ = batch()
    with pytest.raises(ValueError, match="no backward pass on CPU"):
        model(idx, torch.roll(idx, -1, 1))


@pytest.mark.parametrize("pe,ssmax,kv,settings", [
    ("bam", True, 0, {}), ("rope", False, 2, {}), ("sinusoidal", False, 0, {}), ("alibi", True, 0, {}),
    ("nope", False, 0, {}), ("fox", True, 2, {}), ("fire", False, 2, {}), ("rope", True, 0, {"rope_fraction": 0.5}),
    ("rope", False, 2, {"rope_fraction": 0.25, "rope_scaling": "yarn", "rope_factor": 4.0}),
    ("bam", False, 2, ALL_AT_ONCE)])
def test_kv_cache_generation_equals_full_recompute(pe, ssmax, kv, settings):
    generated_equals_recomputed(tiny_model(pe=pe, ssmax=ssmax, n_kv_head=kv, **settings))


@pytest.mark.parametrize("pe", PE_CHOICES)
def test_eager_attention_stays_fp32_under_bf16_autocast(pe, monkeypatch):
    """eager is the reference the other paths are held to, and a GPU runs under bf16 autocast, which would round
    q.k (and the weights' product with v) to 8 bits: from the same inputs it computes what it computes in fp32."""
    model = tiny_model(pe=pe, ssmax=True, attn_impl="eager")
    calls = []
    eager = model_module.ATTENTION["eager"]
    monkeypatch.setitem(model_module.ATTENTION, "eager", lambda *args: calls.append(args) or eager(*args))
    idx, doc_ids = batch()
    with torch.no_grad():
        model(idx, doc_ids=doc_ids)
    plain = eager(*calls[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = eager(*calls[-1])
    assert torch.equal(under_autocast, plain)


class TensorsOffDevice(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every operation that makes a tensor anywhere but on `device`: a factory on the host (e.g.
    torch.arange without device=) or a copy to or from it, which on a GPU is a CPU kernel and a blocking
    host-to-device copy in every forward."""

    def __init__(self, device):
        super().__init__()
        self.device, self.strays = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != self.device:
                self.strays.append(f"{func} -> {t.device}")
        return out


def positional_variants():
    """Every encoding that computes from positions in the forward (a rotation or an embedding), at its defaults
    and its checked settings (partial RoPE), and a rotation under every RoPE scaling, evaluated past its
    original context so dynamic NTK scales too."""
    for pe, settings in CHECKED_SETTINGS:
        encoding = ENCODINGS[pe]
        scalings = RoPE.SCALINGS if encoding.rotation is not None else ("none",)
        if encoding.rotation is None and encoding.embedding is None:
            continue
        for scaling in scalings:
            yield pytest.param(pe, scaling, settings, id=f"{pe}-{scaling}-{settings}")


@pytest.mark.parametrize("pe,scaling,settings", list(positional_variants()))
def test_a_forward_makes_every_tensor_on_the_inputs_device(pe, scaling, settings):
    """The whole forward (embeddings, RoPE's frequencies and ramps, attention, logits) run on the meta device,
    where a tensor built on the host shows as one that is not on meta."""
    factor = 1.0 if scaling == "none" else 4.0
    cfg = tiny_config(pe, attn_impl="sdpa", rope_scaling=scaling, rope_factor=factor, rope_original_context=8, **settings)
    with torch.device("meta"):
        model = Transformer(cfg)
    idx = torch.zeros(2, 24, dtype=torch.long, device="meta")
    with TensorsOffDevice("meta") as mode:
        model(idx)
    assert not mode.strays, mode.strays
