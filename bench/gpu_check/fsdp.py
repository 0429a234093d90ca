"""fsdp: train.parallel = "fsdp" in this process on a world of one rank, the code path of many GPUs:
parallel.prepare as train.py runs it (each Block compiled, flex inside on CUDA, then fully_shard with the bf16
policy), BAM + SSMax with document masks, 3 steps against the same model unsharded under bf16 autocast (the DDP
path); then a torch.distributed.checkpoint save and load of its shards, and the same folder joined into whole
tensors in one process. The process group (NCCL on CUDA, gloo on CPU) is taken down at the end."""

import argparse
import dataclasses
import os
import shutil
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from bam import parallel
from bam.checkpoint import load_checkpoint, step_path
from bench.gpu_check.common import build_optimizer, documents_batch, rel_err
from bench.gpu_check.report import Case, Section, Skip
import model as model_module
from model import Transformer


class ShardedRun:
    """The model, its batches and its training steps, shared by the section's two cases."""

    def __init__(self, s):
        base = s.base
        if s.quick:
            model_cfg, batch_size = dataclasses.replace(base.model, n_layer=2, n_embd=64, n_head=4, vocab_size=512,
                                                        block_size=64), 2
        else:
            model_cfg, batch_size = base.model, 8
        self.s = s
        self.model_cfg = dataclasses.replace(model_cfg, pe="bam", ssmax=True, attn_impl="auto")
        self.train_cfg = dataclasses.replace(base.train, parallel="fsdp", compile=True, optimizer="adamw", lr=1e-3)
        self.T = self.model_cfg.block_size
        self.batch_size = batch_size
        self.model = self.optimizer = None

    def batches(self):
        return [documents_batch(self.batch_size, self.T, self.model_cfg.vocab_size, self.s.device, seed,
                                used_tokens=64) for seed in range(3)]

    def steps(self, model, optimizer, autocast):
        losses = []
        for x, y, doc_ids in self.batches():
            with autocast:
                _, loss = model(x, y, doc_ids=doc_ids)
            loss.backward()
            parallel.clip_grad_norm(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    def sharded_model(self):
        torch.manual_seed(0)
        model = Transformer(self.model_cfg)
        parallel.prepare(model, self.train_cfg, argparse.Namespace(device=self.s.device), self.s.bf16 is not None,
                         self.s.compile_backend)
        return model, build_optimizer(model, self.train_cfg, self.s.device)

    def policy_case(self):
        s = self.s
        torch.manual_seed(0)
        reference = Transformer(self.model_cfg).to(s.device)
        ref_losses = self.steps(reference, build_optimizer(reference, self.train_cfg, s.device), s.autocast(s.bf16))
        model, optimizer = self.sharded_model()
        seen = []
        hook = model.blocks[0].attn.wq.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        losses = self.steps(model, optimizer, nullcontext())
        hook.remove()
        self.model, self.optimizer = model, optimizer
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
        drift = max(rel_err(weights[k], v) for k, v in reference.state_dict().items())
        # Adam moves every weight by ~lr a step whatever its gradient's size, so a weight whose bf16 gradient
        # differs in sign between the two paths ends lr-sized apart: the weights are shown, the losses judged.
        return {"ok": diff < 0.05 and seen[0] == (torch.bfloat16 if s.bf16 is not None else torch.float32),
                "impl": model_module.attention_path(reference, self.T, self.T, True),
                "compiled": f"per Block, {s.compile_backend}",
                "weights_in_forward": str(seen[0]).removeprefix("torch."), "max_loss_diff": diff,
                "weights_rel_diff": drift, "losses": [round(v, 4) for v in losses]}

    def checkpoint_case(self):
        if self.model is None:
            raise Skip("no sharded model: its training case did not finish")
        model, optimizer = self.model, self.optimizer
        run_dir = os.path.join(self.s.work_dir, "fsdp_run")
        folder = step_path(run_dir, 3, sharded=True)
        try:
            parallel.save_fsdp_checkpoint(model, optimizer, {"step": 3}, folder)
            fresh, fresh_optimizer = self.sharded_model()
            parallel.load_fsdp_checkpoint(fresh, fresh_optimizer, folder, load_checkpoint(folder, join_shards=False)[1])
            same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.state_dict().values(),
                                                                              fresh.state_dict().values()))
            whole = load_checkpoint(folder)[1]["model"]  # joined in this process, as the evaluators read it
            joined = all(torch.equal(whole[k], v.full_tensor().cpu()) for k, v in model.state_dict().items())
            next_loss = [self.steps(m, o, nullcontext())[0] for m, o in ((model, optimizer), (fresh, fresh_optimizer))]
            files = len(os.listdir(folder))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            self.model = self.optimizer = None
        return {"ok": same and joined and next_loss[0] == next_loss[1], "shards_equal": same, "joined_equal": joined,
                "next_step_loss": next_loss[0], "resumed_next_step_loss": next_loss[1], "files": files}


def plan(s):
    run = ShardedRun(s)
    # the 121M model's Block compiled once (inductor, flex inside: ~40 s), 3 steps, a DCP save/load
    return [Case("fsdp (world 1) bam+ssmax docs, bf16 policy, compiled Blocks vs bf16 autocast", 10 if s.quick else 60,
                 run.policy_case),
            Case("fsdp DCP save + load (and joined into one process)", 5 if s.quick else 30, run.checkpoint_case)]


@contextmanager
def world_of_one(s):
    parallel.init_distributed(argparse.Namespace(device=s.device, distributed=False), "fsdp")
    try:
        yield
    finally:
        dist.destroy_process_group()


SECTION = Section("fsdp", plan, default=False, around=world_of_one,
                  what="train.parallel = fsdp in-process on a world of one rank: compiled Blocks, bf16 policy, "
                       "a DCP save and load")
