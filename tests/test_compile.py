"""A training step that compiles well, checked on the CPU: the compiled forward with document masking is one
graph (no graph break, hence no host read of a tensor inside it), one BlockMask per forward serves every
layer, and the causal mask is cached per length."""

import dataclasses

import pytest
import torch

import model as model_module
import train
from bam import parallel
from bam.config import TrainConfig
from flex_on_cpu import flex_backward_as_inductor_lowers_it, take_flex
from model import Transformer, check_doc_ids
from tiny_models import VOCAB, assert_grads_equal, tiny_config

pytestmark = pytest.mark.slow  # every test compiles (dynamo's explain, torch.compile, flex kernels)

PROCESS = train.Processes(distributed=False, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def tiny(pe, ssmax, **fields):
    """tests/tiny_models.py's tiny_config, 3 layers deep and as long as this file's batch (64 tokens)."""
    return tiny_config(pe, ssmax, **{"n_layer": 3, "block_size": 64, **fields})


def batch(B=2, T=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    doc_ids = torch.tensor([[0] * 20 + [1] * 30 + [2] * (T - 50), [0] * 41 + [1] * (T - 41)])
    return idx[:, :-1], idx[:, 1:], doc_ids


@pytest.mark.parametrize("pe,ssmax", [("bam", True), ("rope", False), ("sinusoidal", True)])
def test_compiled_forward_with_doc_ids_is_one_graph(pe, ssmax):
    """train.py compiles the model and calls it with doc_ids; on the CPU that is the sdpa path. A graph break
    (e.g. reading doc_ids back to check them) would split the graph and, on a GPU, sync the device."""
    torch.manual_seed(0)
    model = Transformer(tiny(pe, ssmax, attn_impl="sdpa"))
    x, y, doc_ids = batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_flex_with_prior_tables_is_one_graph():
    """The GPU trains on flex, where the prior tables are built inside the forward (model.flex_prior_tables):
    they must trace into the same one graph. On the CPU flex has no backward, so this traces an inference forward;
    bench/gpu_check's graphs section traces the training forward on a GPU."""
    torch.manual_seed(0)
    model = Transformer(tiny("bam", True, attn_impl="flex", flex_prior="table"))
    x, y, doc_ids = batch()
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x, y, doc_ids=doc_ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_explain_sees_a_host_read_of_doc_ids():
    """The check above can fail: the ordering check, traced instead of skipped, is a graph break."""

    class Checked(torch.nn.Module):
        def forward(self, doc_ids):
            check_doc_ids(doc_ids)
            return doc_ids * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(Checked())(batch()[2])
    assert explained.graph_break_count >= 1


@pytest.mark.parametrize("docs", [False, True])
def test_one_block_mask_per_forward_shared_by_all_layers(monkeypatch, docs):
    built, seen = [], []
    real_make = model_module.make_block_mask

    def counting_make(*args):
        built.append(real_make(*args))
        return built[-1]

    def recording_flex(q, k, v, ctx, *rest):
        # flex itself compiles C++ for half a minute on a CPU; what matters here is which mask each layer gets
        seen.append(ctx.mask)
        return torch.zeros_like(q)

    monkeypatch.setattr(model_module, "make_block_mask", counting_make)
    monkeypatch.setitem(model_module.ATTENTION, "flex", recording_flex)
    torch.manual_seed(0)
    model = Transformer(tiny("bam", True, attn_impl="flex"))
    x, _, doc_ids = batch()
    with torch.no_grad():
        model(x, doc_ids=doc_ids if docs else None)
    assert len(built) == 1
    assert len(seen) == model.config.n_layer and all(mask is built[0] for mask in seen)


def test_causal_block_mask_cached_per_length_device_and_mode():
    model_module._kept_causal_block_mask.cache_clear()
    first = model_module.causal_block_mask(300, "cpu")
    assert model_module.causal_block_mask(300, torch.device("cpu")) is first
    other = model_module.causal_block_mask(200, "cpu")
    assert other is not first and other.seq_lengths == (200, 200)
    # the cached mask is the causal mask of its length
    fresh = model_module.write_causal_block_mask(300, "cpu")
    assert torch.equal(first.to_dense(), fresh.to_dense()) and first.seq_lengths == (300, 300)
    with torch.inference_mode():  # inference tensors cannot be saved for a later backward: kept apart
        assert model_module.causal_block_mask(300, "cpu") is not first
    # bounded: a sweep over many lengths keeps only the most recent few
    for T in range(400, 400 + 128 * model_module.CAUSAL_MASKS_KEPT, 128):
        model_module.causal_block_mask(T, "cpu")
    assert model_module._kept_causal_block_mask.cache_info().currsize == model_module.CAUSAL_MASKS_KEPT
    assert model_module.causal_block_mask(300, "cpu") is not first

    # make_block_mask serves the cached mask at flex's CPU length (whole 128-token blocks, model.flex_mask_length)
    assert model_module.make_block_mask(None, 300, "cpu") is model_module.causal_block_mask(384, "cpu")

# ---------------------------------------------------------------------------------------------------
# The GPU's training path traced on the CPU (issue 45, points 1, 2 and 9): flex under activation checkpointing
# and per-Block compile (FSDP), the Block graphs per depth, the whole model's graphs over validation and
# training steps (DDP), and the order DDP and compile are applied in. A GPU trains on flex; here the model is
# told to take flex for training too (flex_on_cpu.take_flex), and the aot_eager / eager backends trace and run it:
# dynamo's guards, recompiles and side-effect rules are the same as a GPU's, inductor's CPU kernel (which has
# no flex backward) is never built.

try:  # a private module: a torch that moves it skips these tests with the reason, never passes them
    from torch._dynamo.testing import CompileCounterWithBackend
except ImportError:
    CompileCounterWithBackend = None

needs_counter = pytest.mark.skipif(CompileCounterWithBackend is None,
                                   reason="torch._dynamo.testing.CompileCounterWithBackend is not in this torch")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process (FSDP and DDP need one; nothing is communicated)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield train.Processes(distributed=True, rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    dist.destroy_process_group()


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """flex_attention refuses inputs that require grad on a CPU, before tracing (inductor's CPU kernel has no
    backward); the aot_eager and eager backends run its backward in plain torch, so that check is lifted, and
    that backward gives a gradient to the captured tensors inductor's gives one to (flex_on_cpu)."""
    import torch.nn.attention.flex_attention as flex_module
    if not hasattr(flex_module, "_validate_device"):
        pytest.skip("torch.nn.attention.flex_attention._validate_device is not in this torch")
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)
    flex_backward_as_inductor_lowers_it(monkeypatch)


def bam_ssmax(n_layer=2, ssmax=True, **kw):
    torch.manual_seed(0)
    model = Transformer(tiny("bam", ssmax, n_layer=n_layer, **kw))
    with torch.no_grad():  # every prior parameter off its init, and each layer's prior its own
        for p in model.prior_parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def eager_reference(model):
    """The same weights on the eager attention path, the reference."""
    import copy
    reference = copy.deepcopy(model)
    reference.config = dataclasses.replace(model.config, attn_impl="eager")
    return reference


def loss_and_grads(model, x, y, doc_ids):
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y, doc_ids=doc_ids)
    loss.backward()
    return logits.detach(), {name.replace("_checkpoint_wrapped_module.", ""): p.grad
                             for name, p in model.named_parameters() if p.grad is not None}


def checkpointed_and_compiled_per_block(model, backend):
    """parallel.prepare's activation checkpointing and per-Block compile, without the sharding."""
    parallel.checkpoint_blocks(model)
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    return model


@needs_counter
@pytest.mark.slow
@pytest.mark.parametrize("flex_prior", ["table", "formula"])
def test_checkpointed_per_block_compiled_flex_runs_the_validation_forward(fresh_dynamo, flex_prior):
    """FSDP + activation_checkpointing = "full" + compile: the step-0 validation is a no_grad forward through the
    checkpointed, compiled Blocks. Writing a module global inside that region (the flex kernel cache, dynamo's
    recompile budget) is an unsafe side effect dynamo refuses under fullgraph."""
    model = bam_ssmax(attn_impl="flex", flex_prior=flex_prior)
    reference = eager_reference(model)
    counter = CompileCounterWithBackend("aot_eager")
    checkpointed_and_compiled_per_block(model, counter)
    x, y, doc_ids = batch()
    with torch.no_grad():
        logits, loss = model(x, y, doc_ids=doc_ids)
        expected, expected_loss = reference(x, y, doc_ids=doc_ids)
    assert counter.frame_count == 1
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@needs_counter
@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "fully_shard"])
def test_the_papers_default_path_per_block_compiled_and_checkpointed_trains_as_eager_does(
        fresh_dynamo, flex_backward_on_cpu, sharded, monkeypatch, request):
    """BAM + SSMax with flex_prior = "table", the paper's model on the GPU's default path: activation checkpointing
    and per-Block compile (fullgraph), as parallel.prepare applies them, and also fully_shard (train.py's FSDP +
    activation_checkpointing = "full" + compile, on a one-rank gloo group). The training forward and backward
    equal eager's: the logits and every gradient, SSMax's scales and the prior's parameters among them. SSMax's
    factor table is built inside the compiled Block, so its gradient is one the backward graph asks flex's
    backward for (flex_on_cpu.flex_backward_as_inductor_lowers_it)."""
    model = take_flex(monkeypatch, bam_ssmax(flex_prior="table"))
    reference = eager_reference(model)
    counter = CompileCounterWithBackend("aot_eager")
    if sharded:
        t = TrainConfig(parallel="fsdp", activation_checkpointing="full", compile=True)
        parallel.prepare(model, t, request.getfixturevalue("one_rank"), bf16=False, compile_backend=counter)
        assert isinstance(model.blocks[0].attn.ssmax_scale, torch.distributed.tensor.DTensor)
    else:
        checkpointed_and_compiled_per_block(model, counter)
    x, y, doc_ids = batch()
    (logits, grads), (expected, expected_grads) = loss_and_grads(model, x, y, doc_ids), \
        loss_and_grads(reference, x, y, doc_ids)
    assert counter.frame_count == 1  # one graph serves both Blocks
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    shaping = {name for name, p in reference.named_parameters()
               if p.requires_grad and any(p is q for q in reference.prior_parameters())}
    assert {"blocks.1.attn.ssmax_scale", "priors.1.shape", "priors.1.log_scale"} <= shaping
    assert all(expected_grads[name].abs().max() > 0 for name in shaping)  # a comparison that can fail
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        grad = grads[name].full_tensor() if sharded else grads[name]
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@needs_counter
@pytest.mark.slow
@pytest.mark.parametrize("ssmax,flex_prior,pattern", [(False, "table", ""), (True, "formula", ""),
                                                      (False, "table", "rope-ssmax@24 bam+ssmax@full"),
                                                      (False, "table", "alibi@24 bam@full")])
def test_checkpointed_per_block_compiled_flex_trains_as_eager_does(fresh_dynamo, flex_backward_on_cpu, ssmax,
                                                                    flex_prior, pattern, monkeypatch):
    """The training forward and backward of the same model, as a GPU runs them (flex with its backward); with a
    layer_pattern, each layer with its own window, prior and SSMax, one Block graph per layer kind."""
    model = bam_ssmax(ssmax=ssmax, flex_prior=flex_prior, layer_pattern=pattern)
    reference = eager_reference(model)
    counter = CompileCounterWithBackend("aot_eager")
    checkpointed_and_compiled_per_block(take_flex(monkeypatch, model), counter)
    x, y, doc_ids = batch()
    (logits, grads), (expected, expected_grads) = loss_and_grads(model, x, y, doc_ids), \
        loss_and_grads(reference, x, y, doc_ids)
    assert counter.frame_count == len(set(model.config.layer_kinds))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert_grads_equal(grads, expected_grads)


@needs_counter
@pytest.mark.slow
@pytest.mark.parametrize("n_layer", [12, 32])
@pytest.mark.parametrize("pe,ssmax,pattern", [("bam", True, ""), ("rope", False, ""), ("fox", True, ""),
                                              ("rope", False, "rope@8*3 bam+ssmax@full")])
def test_per_block_compile_makes_at_most_two_block_graphs_whatever_the_depth(fresh_dynamo, flex_backward_on_cpu,
                                                                             n_layer, pe, ssmax, pattern,
                                                                             monkeypatch):
    """FSDP compiles each Block; every layer must reuse one graph per grad mode (validation and training). A
    guard on the layer's index compiles one per layer, and past dynamo's recompile budget (8 by default)
    fullgraph fails at a later validation (FailOnRecompileLimitHit). With a layer_pattern, one graph per grad
    mode and distinct layer kind (encoding, window, SSMax), not per layer; its flex kernels were all built with
    the model (else the trace raises "no flex kernel ... was built")."""
    torch.manual_seed(0)
    model = take_flex(monkeypatch, Transformer(tiny(pe, ssmax, n_layer=n_layer, n_embd=16, n_head=2,
                                                    layer_pattern=pattern)))
    layer_kinds = len(set(model.config.layer_kinds))
    counter = CompileCounterWithBackend("eager")
    for block in model.blocks:
        block.compile(backend=counter, fullgraph=True)
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    x, y, doc_ids = tokens[:, :-1], tokens[:, 1:], torch.tensor([[0] * 12 + [1] * 20, [0] * 32])
    for _ in range(2):  # validation, training step, validation, training step
        with torch.no_grad():
            model(x, y, doc_ids=doc_ids)
        model(x, y, doc_ids=doc_ids)
    assert counter.frame_count <= 2 * layer_kinds, f"{counter.frame_count} Block graphs for {n_layer} layers"


@needs_counter
@pytest.mark.slow
def test_the_whole_model_compiles_once_per_grad_mode_over_validation_and_training(fresh_dynamo, flex_backward_on_cpu,
                                                                                  monkeypatch):
    """train.compile under DDP compiles the whole model: the step-0 validation, three training steps and the
    next validation must reuse their two graphs. A kernel cache filled during the first trace changes what
    that trace's guards saw, so the training step and the next validation would compile the model again."""
    monkeypatch.setattr(model_module, "_FLEX_KERNELS", {})  # as in a fresh process: no kernel of earlier tests
    model = take_flex(monkeypatch, bam_ssmax())
    counter = CompileCounterWithBackend("eager")
    compiled = parallel.wrap(model, TrainConfig(compile=True), PROCESS, compile_backend=counter)
    x, y, doc_ids = batch()
    graphs = []

    def validate():
        compiled.eval()
        with torch.no_grad():
            compiled(x, y, doc_ids=doc_ids)
        compiled.train()
        graphs.append(counter.frame_count)

    validate()
    for _ in range(3):
        compiled(x, y, doc_ids=doc_ids)[1].backward()
        graphs.append(counter.frame_count)
    validate()
    assert graphs == [1, 2, 2, 2, 2], graphs


@needs_counter
@pytest.mark.slow
def test_ddp_is_applied_before_compile(fresh_dynamo, one_rank):
    """torch's documented order: DDP, then torch.compile, so that dynamo sees the DDP module and splits the graph
    at its buckets (DDPOptimizer), letting the all-reduce of one bucket overlap the backward of the next.
    micro_step's no_sync still reaches DDP through the compiled wrapper; the gradients are eager's."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = Transformer(tiny("bam", True, attn_impl="sdpa"))
    reference = eager_reference(model)
    t = TrainConfig(compile=True)
    wrapped = parallel.wrap(model, t, one_rank, compile_backend="eager")
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule), type(wrapped)
    assert isinstance(wrapped._orig_mod, DDP) and wrapped._orig_mod.module is model
    x, y, doc_ids = batch()
    with parallel.micro_step(wrapped, t, one_rank, last=False):  # DDP's no_sync
        wrapped(x, y, doc_ids=doc_ids)[1].backward()
    with parallel.micro_step(wrapped, t, one_rank, last=True):
        wrapped(x, y, doc_ids=doc_ids)[1].backward()
    for _ in range(2):
        reference(x, y, doc_ids=doc_ids)[1].backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
