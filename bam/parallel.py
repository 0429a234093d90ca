"""
How the model is spread over the ranks (train.parallel), and what a spread model needs to be trained,
logged and checkpointed.

- "ddp" (the default): every rank holds the whole model and optimizer; DistributedDataParallel averages
  the gradients. Simplest and fastest while the model, its gradients and AdamW's two moments fit one GPU
  (16 bytes per parameter: about 1.2B parameters on 80 GB before activations).
- "fsdp": FSDP2 (torch.distributed.fsdp.fully_shard) over a 1-D mesh of every rank. Each rank holds
  1/world of every weight, gradient and optimizer moment; a group's weights are all-gathered just before
  its forward (and again for its backward when train.reshard_after_forward), its gradients reduce-scattered
  right after its backward. The groups, as torchtitan forms them:
    each Block       attention, SwiGLU, both norms, and SSMax's per-head scales
    tok_emb          the embedding
    norm + lm_head   one group, kept gathered from the forward to the backward that needs it at once
    the root         what is left: the learned positional priors (model.priors: BAM's shapes, scales and
                     locations, KERPLE's r1 and r2), a few hundred numbers gathered once per forward
  With bf16 (train.dtype, or auto on a GPU that has it) the policy is MixedPrecisionPolicy(bfloat16 weights
  for compute, float32 gradient reduction) in place of autocast; the optimizer updates float32 shards. The
  root keeps the priors in float32, as autocast does on DDP: they enter every logit and cost nothing.

Either way train.activation_checkpointing = "full" wraps each Block in checkpoint_wrapper (its activations
are recomputed in the backward, from the Block's input), and train.compile compiles each Block under FSDP
(after checkpointing and before sharding, as torchtitan does: FSDP's hooks stay outside the graphs; each
layer's prior table is an argument, so one graph per grad mode serves every Block) and the whole model under
DDP (after DDP wraps it, torch's documented order: see wrap). Nothing inside a compiled region writes module
state: the flex kernels are built when the model is made (model.build_flex_kernels). Under FSDP
the weights are DTensors: read them through this module (prior_summary, clip_grad_norm, the checkpoint
functions), never with .tolist() or .item() on a parameter.
"""

import dataclasses
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

from bam.checkpoint import CheckpointError, dcp_quiet, save_sharded


def init_distributed(procs, parallel):
    """The default process group: NCCL on GPUs, gloo on CPUs, for the ranks torchrun started. FSDP without
    torchrun runs on a process group of one rank (the same code path, nothing to communicate)."""
    backend = "nccl" if procs.device.type == "cuda" else "gloo"
    device_id = procs.device if procs.device.type == "cuda" else None
    if procs.distributed:
        dist.init_process_group(backend=backend, device_id=device_id)
    elif parallel == "fsdp":
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)


def is_dtensor(x):
    """Whether x is a DTensor, without importing torch.distributed.tensor: that import (sympy with it) is about
    half of train.py's start-up, and no DTensor exists before FSDP (fully_shard) has imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


# ---------------------------------------------------------------------------------------------------
# Wrapping the model: activation checkpointing, then per-Block compile and FSDP, or DDP and then compile


def prepare(model, train, procs, bf16, compile_backend="inductor"):
    """Change `model` in place before its optimizer is made: activation checkpointing on each Block, and
    under FSDP the per-Block compile and the sharding (which turns the parameters into DTensor shards). The
    model stays the one whose state_dict and prior_summary are read."""
    if train.activation_checkpointing == "full":
        checkpoint_blocks(model)
    if train.parallel != "fsdp":
        return model
    if train.compile:
        for block in model.blocks:  # one code object, so one graph serves every layer
            block.compile(backend=compile_backend, fullgraph=True)
    shard(model, procs.device, bf16, train.reshard_after_forward)
    return model


def checkpoint_blocks(model):
    """Full activation checkpointing per Block, applied from outside the model as torchtitan does: each Block
    keeps only its input for the backward, which runs its forward again. The wrapper's state_dict has the
    Block's names, so checkpoints do not change."""
    for i, block in enumerate(model.blocks):
        # Non-reentrant (the default): it takes the Block's non-tensor arguments (the attention context, the
        # prior module) and restores the RNG state for the recomputation (the model draws nothing).
        model.blocks.register_module(str(i), checkpoint_wrapper(block))


def shard(model, device, bf16, reshard_after_forward):
    """fully_shard the groups of the module docstring, innermost first, over a mesh of every rank. The mesh
    is made explicitly: on a CUDA build the default would be a CUDA mesh even for a CPU run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model.tok_emb, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy())  # the root: the priors, in float32


def wrap(model, train, procs, compile_backend="inductor"):
    """What the training step calls: under DDP the model wrapped in DDP, then compiled whole; under FSDP the
    model itself (prepare did it all). DDP first is torch's documented order: dynamo then sees the DDP module
    and splits the graph at its gradient buckets (DDPOptimizer), so that the all-reduce of one bucket overlaps
    the backward of the next; the other way round, DDP's hooks wait for the whole compiled backward. The
    compiled module passes attribute reads on to DDP (micro_step's no_sync)."""
    if train.parallel == "fsdp":
        return model
    if procs.distributed:
        model = DDP(model, device_ids=[procs.local_rank] if procs.device.type == "cuda" else None)
    if train.compile:
        model = torch.compile(model, backend=compile_backend)
    return model


def micro_step(model, train, procs, last):
    """The context of one micro-batch's forward and backward. DDP all-reduces only after the last one of the
    step (no_sync before: the same bytes accum_steps times for nothing). FSDP reduce-scatters after each one,
    so that gradients stay sharded, unless train.fsdp_grad_sync = "step": then, like DDP, only after the last
    (set_requires_gradient_sync), at the price of every rank accumulating the whole model's gradients."""
    if train.parallel == "fsdp":
        model.set_requires_gradient_sync(last or train.fsdp_grad_sync == "micro_batch")
        return nullcontext()
    return model.no_sync() if procs.distributed and not last else nullcontext()


def clip_grad_norm(parameters, max_norm):
    """The global gradient norm before clipping to max_norm (a 0-d tensor), as torch.nn.utils.clip_grad_norm_
    computes it. Under FSDP each rank holds shards of the gradients: the norm of its shards is a partial
    result (a DTensor) and full_tensor() sums the squares over the ranks."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


@torch.no_grad()
def prior_summary(model):
    """model.prior_summary() with whole values on every rank. Under FSDP the priors and SSMax scales are
    DTensor shards: each is gathered (full_tensor, a collective every rank joins) and put in its module's
    place while the summary reads it, then the shard goes back."""
    priors = {id(p) for p in model.prior_parameters()}
    sharded = [(module, name, p) for module in model.modules() for name, p in module._parameters.items()
               if is_dtensor(p) and id(p) in priors]
    try:
        for module, name, p in sharded:
            module._parameters[name] = torch.nn.Parameter(p.full_tensor(), requires_grad=False)
        return model.prior_summary()
    finally:
        for module, name, p in sharded:
            module._parameters[name] = p


# ---------------------------------------------------------------------------------------------------
# Checkpoints of a sharded model (their folder format: bam/checkpoint.py)


def save_fsdp_checkpoint(model, optimizer, state, path):
    """Write `state` (step, config, loader, this rank's RNG, ...) and every rank's shards of the model (and of
    the optimizer, unless None: best/ holds weights only) as the sharded checkpoint folder `path`. Every rank
    calls it; the RNG states of all of them are kept, rank 0's also as "rng" (the layout of a .pt file)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    tensors = {"model": get_model_state_dict(model)}
    state = {**state, "model_config": dataclasses.asdict(model.config)}
    if optimizer is not None:
        full = get_optimizer_state_dict(model, optimizer)  # keyed by parameter name, the shards as DTensors
        tensors["optimizer"] = {"state": full["state"]}
        state["optimizer_param_groups"] = full["param_groups"]
    if "rng" in state:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, state["rng"])
        state["rng_per_rank"] = per_rank
    save_sharded(tensors, state, path)


def load_fsdp_checkpoint(model, optimizer, path, state):
    """Load the shards of the sharded checkpoint folder `path` (whose state.json is `state`) into the sharded
    model and optimizer; torch.distributed.checkpoint reshards them when the number of ranks changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    weights = get_model_state_dict(model)
    moments = get_optimizer_state_dict(model, optimizer)  # a fresh optimizer's state is made first, to load into
    try:
        with dcp_quiet():  # its logged tracebacks: the CheckpointError below is the one line
            dcp.load({"model": weights, "optimizer": {"state": moments["state"]}}, checkpoint_id=path)
    except CheckpointException as e:  # raised on every rank alike (DCP gathers the failures)
        reason = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"cannot load the checkpoint {path}: {reason}", str(reason)) from None
    set_model_state_dict(model, weights)
    set_optimizer_state_dict(model, optimizer, {"state": moments["state"],
                                                "param_groups": state["optimizer_param_groups"]})


def load_whole_optimizer(model, optimizer, numbered):
    """Load a whole optimizer state in torch's layout (a .pt checkpoint's, numbered in param-group order) into
    the optimizer of a sharded model; every rank holds all of it and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    groups = get_optimizer_state_dict(model, optimizer)["param_groups"]  # parameter names, in the same order
    name = {i: n for saved, group in zip(numbered["param_groups"], groups)
            for i, n in zip(saved["params"], group["params"])}
    by_name = {"state": {name[i]: s for i, s in numbered["state"].items()},
               "param_groups": [{**saved, "params": group["params"]}
                                for saved, group in zip(numbered["param_groups"], groups)]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def rank_rng_state(state, rank):
    """This rank's RNG state from a checkpoint: its own when the checkpoint's run had this rank, else rank 0's
    (the run then has more ranks than before; the model draws nothing, so no result depends on it)."""
    per_rank = state.get("rng_per_rank") or [state["rng"]]
    return per_rank[rank] if rank < len(per_rank) else per_rank[0]
