"""train.py end to end on CPU: learning on real text, torchrun/gloo against gradient accumulation,
exact resume without replaying data, a kill during a checkpoint write, non-finite losses, clear
errors, wandb offline, and what lands in metrics.jsonl and the checkpoints."""

import errno
import glob
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import train
from bam import checkpoint, data, recovery
from bam.checkpoint import load_model
from bam.cli import UserError
from bam.config import load_config, to_dict
from bam.tokenizer import GPT2_IDENTITY, load_tokenizer
from model import Transformer
from small_runs import ACCUM, ROOT, newest, rows, small_config
from tiny_models import relative_error, tiny_model

pytestmark = pytest.mark.slow  # python train.py and torchrun launches, and whole training runs


def test_lr_schedule():
    t = load_config(None, ["--train.max_steps=100", "--train.warmup_steps=10", "--train.min_lr_frac=0.1"]).train
    assert [train.lr_multiplier(s, t) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert train.lr_multiplier(10, t) == pytest.approx(1.0)
    assert train.lr_multiplier(55, t) == pytest.approx(0.55)  # half way through the cosine: the mean
    assert train.lr_multiplier(100, t) == pytest.approx(0.1)  # ends at the floor, never below
    multipliers = [train.lr_multiplier(s, t) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(multipliers, multipliers[1:]))
    t.decay = "linear"
    assert train.lr_multiplier(55, t) == pytest.approx(0.55) and train.lr_multiplier(32.5, t) == pytest.approx(0.775)
    t.decay = "constant"
    assert train.lr_multiplier(99, t) == 1.0


def test_resume_reproduces_the_uninterrupted_run(tmp_path, synthetic, monkeypatch):
    cfg = small_config(tmp_path, synthetic)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train.main([cfg, f"--log.out_dir={straight}"])

    # The same run stopped right after its step-3 checkpoint, as a preempted job would be.
    save_atomic = train.save_atomic

    def save_then_stop(obj, path):
        save_atomic(obj, path)
        if path.endswith("step_00000003.pt"):
            raise KeyboardInterrupt
    monkeypatch.setattr(train, "save_atomic", save_then_stop)
    with pytest.raises(SystemExit) as info:
        train.main([cfg, f"--log.out_dir={resumed}"])
    assert info.value.code == recovery.EXIT_INTERRUPTED
    monkeypatch.setattr(train, "save_atomic", save_atomic)

    # Resuming seeks the loader: it reads only the batches of the remaining steps.
    reads = []
    next_batch = data.ShardLoader.next_batch
    monkeypatch.setattr(data.ShardLoader, "next_batch", lambda self: reads.append(self.split) or next_batch(self))
    train.main([cfg, f"--log.out_dir={resumed}", "--resume"])
    assert reads.count("train") == 3 * ACCUM

    def comparable(run_dir):  # everything but the wall clock
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows(run_dir)]
    assert comparable(resumed) == comparable(straight)  # losses, val losses, lrs, grad norms, priors
    assert [row["step"] for row in rows(resumed)] == list(range(7))  # no duplicated rows
    a, b = newest(straight), newest(resumed)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for i, state in a["optimizer"]["state"].items():
        for key in state:
            assert torch.equal(state[key], b["optimizer"]["state"][i][key]), (i, key)
    assert a["loader"] == b["loader"] and a["step"] == b["step"] == 6 and a["tokens_seen"] == 6 * ACCUM * 64


class FakeGPUs:
    """torch.cuda's generator functions on `visible` pretend devices, each with its own 16-byte state; asking
    for a device past them fails as CUDA does."""

    def __init__(self, monkeypatch, visible):
        self.visible, self.restored = visible, []
        self.states = {i: torch.full((16,), 10 + i, dtype=torch.uint8) for i in range(visible)}
        for name in ("is_available", "device_count", "current_device", "get_rng_state", "get_rng_state_all",
                     "set_rng_state", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def index(self, device):
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= self.visible:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def is_available(self):
        return True

    def device_count(self):
        return self.visible

    def current_device(self):
        return 0

    def get_rng_state(self, device="cuda"):
        return self.states[self.index(device)].clone()

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.visible)]

    def set_rng_state(self, state, device="cuda"):
        self.restored.append((self.index(device), state.tolist()))

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def test_rng_state_of_a_rank_on_8_gpus_resumes_on_1(tmp_path, monkeypatch):
    """A torchrun rank on a machine with 8 visible GPUs keeps its own device's generator; resumed where one
    GPU is visible, that state goes to the one device, in a .pt file and in a sharded checkpoint's state.json."""
    saving = FakeGPUs(monkeypatch, visible=8)
    state = recovery.rng_state(torch.device("cuda", 3))  # LOCAL_RANK 3
    assert torch.equal(state["cuda"], saving.states[3])
    torch.save(state, tmp_path / "rng.pt")
    as_json = json.loads(json.dumps(state, default=torch.Tensor.tolist))
    for saved in (torch.load(tmp_path / "rng.pt", weights_only=True), as_json):
        resuming = FakeGPUs(monkeypatch, visible=1)
        recovery.set_rng_state(saved, torch.device("cuda", 0))
        assert resuming.restored == [(0, [13] * 16)]


def test_rng_state_of_every_visible_gpu_from_older_checkpoints_still_resumes(monkeypatch):
    """Checkpoints written before hold every visible device's generator: the rank's local device takes its
    own entry, or the first where the list is shorter; on the CPU the list is ignored."""
    FakeGPUs(monkeypatch, visible=8)
    older = {**recovery.rng_state("cpu"), "cuda": torch.cuda.get_rng_state_all()}
    for saved in (older, json.loads(json.dumps(older, default=torch.Tensor.tolist))):
        for visible, device, entry in ((1, 0, 0), (8, 3, 3), (2, 1, 1)):
            gpus = FakeGPUs(monkeypatch, visible=visible)
            recovery.set_rng_state(saved, torch.device("cuda", device))
            assert gpus.restored == [(device, [10 + entry] * 16)]
        gpus = FakeGPUs(monkeypatch, visible=1)
        recovery.set_rng_state(saved, torch.device("cpu"))
        assert gpus.restored == []


def test_batches_reach_a_gpu_from_page_locked_memory(synthetic, monkeypatch):
    """A copy from pageable memory may wait for the GPU's queued work before it starts; next_batch pins the
    batch first and copies asynchronously. On the CPU the loader's own tensors are returned, untouched."""
    loader = data.ShardLoader(synthetic, "train", 2, 32)
    x, y, doc_ids = loader.next_batch()
    loader.reset()
    same = train.next_batch(loader, "all", torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(same, (x, y, doc_ids)))

    pinned, copies = set(), []

    def pin_memory(self):
        pinned.add(id(self))
        return self

    def to(self, device, non_blocking=False):
        copies.append((id(self) in pinned, torch.device(device).type, non_blocking))
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    train.next_batch(loader, "all", torch.device("cuda", 0))
    assert copies == [(True, "cuda", True)] * 3


def test_save_best_writes_best_pt_only_on_a_new_lowest_validation_loss_and_atomically(tmp_path, monkeypatch):
    """validate's write, on its own: a loss that is not lower (equal, higher, NaN) leaves best.pt alone; a failed
    write is one line and leaves the previous best.pt whole with no temp file; a new best removes a best of the
    other layout (a sharded best/ from before a change of train.parallel)."""
    cfg = load_config(None, [f"--log.out_dir={tmp_path}"])
    run = SimpleNamespace(cfg=cfg, procs=train.Processes(False, 0, 0, 1, torch.device("cpu")), sharded=False,
                          raw_model=tiny_model(),
                          train_loader=SimpleNamespace(tokenizer=GPT2_IDENTITY), state=train.TrainState())
    best, folder = checkpoint.best_path(str(tmp_path)), checkpoint.checkpoint_dir(str(tmp_path))
    os.makedirs(checkpoint.best_path(str(tmp_path), sharded=True))
    train.save_best(run, 3, 2.5)
    saved = torch.load(best, weights_only=True)
    assert (saved["step"], saved["val_loss"], run.state.best_val_loss) == (3, 2.5, 2.5)
    assert saved["config"] == to_dict(cfg) and saved["tokenizer"] == GPT2_IDENTITY.to_dict()
    assert os.listdir(folder) == ["best.pt"]  # the sharded best/ is gone
    for not_lower in (2.5, 3.0, math.nan):
        train.save_best(run, 6, not_lower)
    assert torch.load(best, weights_only=True)["step"] == 3 and run.state.best_val_loss == 2.5

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match=f"^cannot write {best}: the disk is full"):
        train.save_best(run, 9, 1.0)
    monkeypatch.undo()
    assert torch.load(best, weights_only=True)["step"] == 3 and os.listdir(folder) == ["best.pt"]
    train.save_best(run, 12, 0.5)
    assert torch.load(best, weights_only=True)["step"] == 12


def test_an_old_run_with_train_doc_mask_resumes_initialises_and_reads_as_a_new_one(tmp_path, synthetic, capsys):
    """Runs written before data.doc_mask kept it as train.doc_mask, in config.toml and in every checkpoint."""
    cfg = small_config(tmp_path, synthetic)
    old, tuned = str(tmp_path / "old"), str(tmp_path / "tuned")
    short = ["--data.doc_mask=false", "--train.val_every=0", "--train.warmup_steps=0"]
    train.main([cfg, f"--log.out_dir={old}", "--train.max_steps=2", *short])
    new_layout = load_config(os.path.join(old, "config.toml"))
    for path in glob.glob(os.path.join(old, "checkpoints", "step_*.pt")):  # rewrite the run as the old code wrote it
        ckpt = torch.load(path, weights_only=True)
        ckpt["config"]["train"]["doc_mask"] = ckpt["config"]["data"].pop("doc_mask")
        torch.save(ckpt, path)
    text = open(os.path.join(old, "config.toml")).read().replace("doc_mask = false\n", "")
    open(os.path.join(old, "config.toml"), "w").write(text.replace("[train]\n", "[train]\ndoc_mask = false\n"))

    assert load_config(os.path.join(old, "config.toml")) == new_layout
    assert checkpoint.load_checkpoint(old)[1]["config"] == to_dict(new_layout)
    capsys.readouterr()
    train.main([os.path.join(old, "config.toml"), "--resume", "--train.max_steps=3"])
    assert "changed settings: train.max_steps: 2 -> 3\n" in capsys.readouterr().out  # and nothing else
    assert newest(old)["step"] == 3
    assert not newest(old)["config"]["data"]["doc_mask"] and "doc_mask" not in newest(old)["config"]["train"]
    train.main([cfg, f"--log.out_dir={tuned}", f"--train.init_from={old}", "--train.max_steps=1", *short])
    assert newest(tuned)["step"] == 1


def test_run_directory_checkpoints_and_metrics(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    run = str(tmp_path / "run")
    train.main([cfg, f"--log.out_dir={run}"])

    names = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert names == ["best.pt", "step_00000005.pt", "step_00000006.pt"]  # keep_last = 2, plus the best
    resolved = load_config(cfg, [f"--log.out_dir={run}"])
    assert load_config(os.path.join(run, "config.toml")) == resolved
    ckpt = newest(run)
    assert ckpt["config"] == to_dict(resolved) and ckpt["model_config"] == to_dict(resolved)["model"]
    assert set(ckpt) >= {"model", "optimizer", "step", "loader", "rng", "best_val_loss", "tokens_seen"}

    table = rows(run)
    assert table[0]["step"] == 0 and "val_loss" in table[0]  # the untrained model's val loss
    assert [r["step"] for r in table if "val_loss" in r] == [0, 3, 6]
    for row in table[1:]:
        assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "prior"} <= set(row)
        assert "mfu" not in row  # no known peak on a CPU
        prior = row["prior"]
        for kind in ("bam_shape", "bam_log_scale", "ssmax_scale"):
            assert np.shape(prior[kind]) == (2, 4), kind  # every head of every layer
    shapes = np.array([row["prior"]["bam_shape"] for row in table])
    assert not np.allclose(shapes[0], shapes[-1])  # they evolve, and the evolution is recorded

    # best.pt is the lowest validation loss, loadable on its own
    best_step = min((r for r in table if "val_loss" in r), key=lambda r: r["val_loss"])["step"]
    assert torch.load(os.path.join(run, "checkpoints", "best.pt"), weights_only=True)["step"] == best_step
    assert isinstance(load_model(os.path.join(run, "checkpoints", "best.pt")), Transformer)

    # param groups: the prior and SSMax parameters have their own lr and no weight decay
    groups = {g["name"]: g for g in ckpt["optimizer"]["param_groups"]}
    assert groups["prior"]["lr"] == pytest.approx(2 * groups["decay"]["lr"])  # prior_lr 2e-3 vs lr 1e-3
    assert (groups["decay"]["weight_decay"], groups["no_decay"]["weight_decay"], groups["prior"]["weight_decay"]) == (0.1, 0, 0)
    assert len(groups["prior"]["params"]) == 2 * 3  # per layer: BAM shape and log-scale, SSMax scale


def test_ddp_with_gloo_matches_gradient_accumulation(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    single, ddp = str(tmp_path / "single"), str(tmp_path / "ddp")
    train.main([cfg, f"--log.out_dir={single}", "--train.max_steps=4"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "train.py", cfg, f"--log.out_dir={ddp}", "--train.max_steps=4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 x 32 x 2 ranks x 1 accumulation steps" in proc.stdout  # really two ranks, no accumulation

    one, two = rows(single), rows(ddp)
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key in ("loss", "val_loss", "grad_norm"):
            if key in a:
                assert abs(a[key] - b[key]) / abs(a[key]) < 1e-5, (a["step"], key, a[key], b[key])
    a, b = newest(single)["model"], newest(ddp)["model"]
    for name in a:
        assert relative_error(b[name], a[name], norm="l2") < 1e-5, name


KILLER = """
import os, signal, sys, torch
import train
real_save, calls = torch.save, []

def dying_save(obj, f, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # the second checkpoint: write some of it, then die like a preempted node
        f.write(b"PK\\x03\\x04 half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *args, **kwargs)

torch.save = dying_save
train.main(sys.argv[1:])
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    run = str(tmp_path / "killed")
    args = [cfg, f"--log.out_dir={run}", "--train.val_every=0", "--train.ckpt_every=2", "--model.pe=alibi"]
    proc = subprocess.run([sys.executable, "-c", KILLER, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-3000:]
    ckpt_dir = os.path.join(run, "checkpoints")
    assert glob.glob(os.path.join(ckpt_dir, "step_00000004.pt.tmp-*"))  # died mid-write
    assert sorted(glob.glob(os.path.join(ckpt_dir, "step_*.pt"))) == [os.path.join(ckpt_dir, "step_00000002.pt")]
    assert newest(run)["step"] == 2
    assert isinstance(load_model(run), Transformer)

    train.main(args + ["--resume"])
    assert newest(run)["step"] == 6 and not glob.glob(os.path.join(ckpt_dir, "*.tmp*"))
    assert [r["step"] for r in rows(run)] == list(range(1, 7))
    assert np.shape(rows(run)[-1]["prior"]["alibi_slope"]) == (1, 4)  # ALiBi's fixed slopes, shared by layers


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, synthetic, monkeypatch, capsys):
    class BlowsUpAtStep3(Transformer):
        micro_steps = 0

        def forward(self, *args, **kwargs):
            logits, loss = super().forward(*args, **kwargs)
            if self.training:
                BlowsUpAtStep3.micro_steps += 1
                if BlowsUpAtStep3.micro_steps > 2 * ACCUM:
                    loss = loss * float("nan")
            return logits, loss
    monkeypatch.setattr(train, "Transformer", BlowsUpAtStep3)
    run = str(tmp_path / "nan")
    with pytest.raises(SystemExit) as info:
        train.main([small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--train.val_every=0"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "error: diverged at step 3: non-finite loss or gradient (loss nan" in err, err
    # Step 3's loss came from step 2's weights: resuming goes back to step 1, step 2 is set aside.
    assert "--resume --train.lr=0.0005` continues from " in err and "step_00000001.pt" in err
    assert newest(run)["step"] == 1 and [r["step"] for r in rows(run)] == [1, 2, 3]
    # the last row says where and why it stopped (a report draws the curve of a run that did not train)
    assert rows(run)[-1] == {"step": 3, "diverged": "non-finite loss or gradient (loss nan, grad norm nan)"}
    assert os.path.exists(os.path.join(run, "checkpoints", "step_00000002.pt.rejected"))


@pytest.mark.parametrize("overrides,expected", [
    (["--train.lrr=1"], "unknown key 'lrr' in [train]"),
    (["--train.optimizer=sgd"], "choose one of: radam, adamw"),
    (["--train.max_steps=1e3"], "expected an integer"),
    (["--train.tokens_per_step=100"], "is not a multiple of data.batch_size x model.block_size x world size"),
    (["--data.data_dir=/nonexistent"], "data.data_dir = '/nonexistent' holds no *_train_*.bin shards"),
    (["--model.vocab_size=1000"], "model.vocab_size = 1000 cannot hold the GPT-2 tokens"),
    (["--data.loss_on=passkey_answers"], "has no passkey answer to train on"),
    (["--data.loss_on=answers"], "choose one of: all, passkey_answers"),
    (["--model.block_size=4096", "--data.batch_size=1", "--train.tokens_per_step=4096", "--train.val_tokens=4096"],
     "cannot use the shards in"),  # the validation split is shorter than one sequence
])
def test_bad_configs_fail_with_one_line_and_write_nothing(tmp_path, synthetic, capsys, overrides, expected):
    run = str(tmp_path / "never")
    with pytest.raises(SystemExit) as info:
        train.main([small_config(tmp_path, synthetic), f"--log.out_dir={run}", *overrides])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not os.path.exists(run)


def test_cli_error_is_one_line_without_traceback_and_existing_runs_are_kept(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    proc = subprocess.run([sys.executable, "train.py", cfg, "--train.decay=exponential"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: [train] decay = 'exponential' (command line): choose one of: cosine, linear, constant"]

    run = str(tmp_path / "done")
    short = [f"--log.out_dir={run}", "--train.max_steps=1", "--train.warmup_steps=0"]
    train.main([cfg, *short])
    before = {p: os.path.getmtime(p) for p in glob.glob(os.path.join(run, "**", "*"), recursive=True)}
    proc = subprocess.run([sys.executable, "train.py", cfg, *short],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "already holds checkpoints" in proc.stderr and "--resume" in proc.stderr
    assert {p: os.path.getmtime(p) for p in before} == before

    # resuming with a different model is refused; a longer run is allowed
    with pytest.raises(SystemExit):
        train.main([cfg, *short, "--resume", "--model.n_layer=3"])
    train.main([cfg, *short, "--resume", "--train.max_steps=2"])
    assert newest(run)["step"] == 2


def test_wandb_offline_writes_its_files(tmp_path, synthetic, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = str(tmp_path / "wandb_run")
    train.main([small_config(tmp_path, synthetic), f"--log.out_dir={run}", "--log.wandb=offline",
                "--train.max_steps=2", "--log.run_name=test"])
    [log_file] = glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb"))
    with open(log_file, "rb") as f:
        logged = f.read()
    for key in (b"loss", b"val_loss", b"grad_norm", b"tokens_per_s", b"prior/bam_shape", b"prior/ssmax_scale"):
        assert key in logged, key  # the metrics.jsonl columns went to wandb too
    assert newest(run)["wandb_id"] in log_file  # a resumed run continues this wandb run


def test_adamw_and_bf16_autocast(tmp_path, synthetic):
    cfg = small_config(tmp_path, synthetic)
    fp32, bf16 = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    for run, dtype in ((fp32, "float32"), (bf16, "bfloat16")):
        train.main([cfg, f"--log.out_dir={run}", "--train.optimizer=adamw", f"--train.dtype={dtype}",
                    "--train.max_steps=2", "--train.val_every=0"])
    assert "amsgrad" in newest(bf16)["optimizer"]["param_groups"][0]  # AdamW's, not RAdam's
    a, b = rows(fp32)[0]["loss"], rows(bf16)[0]["loss"]
    assert 0 < abs(a - b) < 0.05, (a, b)  # autocast really ran in bf16, and stayed close


@pytest.fixture(scope="module")
def demo_corpus(tmp_path_factory):
    """Real English text (Python's own documentation) through the real tokenizer and shard writer: a validation
    shard and two training shards, more than the 20,480 tokens the test below trains on."""
    path = str(tmp_path_factory.mktemp("demo"))
    proc = subprocess.run([sys.executable, "prepare_fineweb.py", "--source", "demo", "--out_dir", path,
                           "--max_tokens", "75000", "--shard_size", "25000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


def test_tiny_config_lowers_the_loss_on_real_text(tmp_path, demo_corpus):
    # configs/tiny.toml's model, learning rate and warmup for 40 steps of one micro-batch (512 tokens, not its
    # 1,024: half the compute, and the 50,257-way output layer is most of it), validated on 4,096 tokens. Over
    # seeds 1337, 1 and 2 the validation loss fell by 3.24-3.33 (bound 2.5); the training loss, logged from
    # step 5 (its first 10.80-10.86), by 3.09-3.21.
    run = str(tmp_path / "tiny")
    train.main(["configs/tiny.toml", f"--data.data_dir={demo_corpus}", f"--log.out_dir={run}",
                "--train.max_steps=40", "--train.tokens_per_step=512", "--train.val_every=40",
                "--train.val_tokens=4096", "--train.ckpt_every=0", "--log.log_every=5"])
    table = rows(run)
    first_val, last_val = table[0]["val_loss"], table[-1]["val_loss"]
    assert first_val == pytest.approx(math.log(50257), abs=0.5)  # untrained: about uniform
    assert last_val < first_val - 2.5, (first_val, last_val)
    train_losses = [r["loss"] for r in table if "loss" in r]
    assert np.mean(train_losses[-2:]) < train_losses[0] - 2.5


@pytest.fixture(scope="module")
def passkey_corpus(tmp_path_factory):
    """Passkey documents of 50-100 tokens: rows of 128 hold 0, 1 or 2 whole ones."""
    from prepare_fineweb import main as prepare_main
    path = str(tmp_path_factory.mktemp("passkey"))
    prepare_main(["--source", "retrieval", "--max_tokens", "30000", "--shard_size", "10000", "--workers", "1",
                  "--retrieval_length", "100", "--retrieval_filler", "garbage", "--out_dir", path])
    return path


def test_passkey_answer_loss_counts_every_target_once(tmp_path, passkey_corpus):
    """Two micro-batches with different numbers of answers make the update of one batch of both:
    the loss is the mean over all the step's targets, not the mean of the micro-batches' means."""
    from bam.retrieval import passkey_answer_targets
    loader = data.ShardLoader(passkey_corpus, "train", 2, 128)
    counts = [int((passkey_answer_targets(*loader.next_batch()[:2], load_tokenizer("gpt2")) != -1).sum())
              for _ in range(2)]
    assert counts[0] != counts[1], counts  # otherwise this test could not tell the two apart
    common = [f"--data.data_dir={passkey_corpus}", "--data.loss_on=passkey_answers", "--model.block_size=128",
              "--train.tokens_per_step=512", "--train.max_steps=1", "--train.warmup_steps=0",
              "--train.val_every=0", "--train.ckpt_every=1"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train.main([small_config(tmp_path, passkey_corpus), *common, "--data.batch_size=4", f"--log.out_dir={one}"])
    train.main([small_config(tmp_path, passkey_corpus), *common, "--data.batch_size=2", f"--log.out_dir={two}"])
    assert rows(one)[-1]["loss"] == pytest.approx(rows(two)[-1]["loss"], rel=1e-5)
    a, b = newest(one)["model"], newest(two)["model"]
    for name in a:
        assert relative_error(b[name], a[name], norm="l2") < 1e-5, name


def test_init_from_loads_weights_only_and_refuses_other_shapes(tmp_path, synthetic, monkeypatch, capsys):
    cfg = small_config(tmp_path, synthetic)
    base, tuned = str(tmp_path / "base"), str(tmp_path / "tuned")
    short = ["--train.max_steps=2", "--train.warmup_steps=0", "--train.val_every=0"]
    train.main([cfg, f"--log.out_dir={base}", *short])
    source = newest(base)

    built = {}
    build_model = train.build_model

    def recording(*args, **kwargs):  # the model and optimizer as they are before the first step
        model, optimizer, base_lr = build_model(*args, **kwargs)
        built.update(weights={k: v.clone() for k, v in model.state_dict().items()}, state=dict(optimizer.state))
        return model, optimizer, base_lr
    monkeypatch.setattr(train, "build_model", recording)
    # The usual context extension: 4x the context, same weights (block_size does not shape a parameter)
    longer = ["--model.block_size=128", "--train.tokens_per_step=256", "--model.attn_impl=eager"]
    train.main([cfg, f"--log.out_dir={tuned}", f"--train.init_from={base}", *short, *longer])
    assert built["weights"].keys() == source["model"].keys()
    for name, tensor in source["model"].items():
        assert torch.equal(built["weights"][name], tensor), name
    assert built["state"] == {}  # a fresh optimizer
    after = newest(tuned)
    assert after["step"] == 2 and after["tokens_seen"] == 2 * 256  # a fresh step count and data position
    assert after["model_config"]["block_size"] == 128
    assert not torch.equal(after["model"]["tok_emb.weight"], source["model"]["tok_emb.weight"])  # it trained
    assert load_config(os.path.join(tuned, "config.toml")).train.init_from == base

    # A different width, or SSMax switched off (it owns parameters), is one line and writes nothing.
    capsys.readouterr()
    for change, named in (("--model.n_embd=64", "model.n_embd: 32 -> 64"), ("--model.ssmax=false", "model.ssmax")):
        run = str(tmp_path / "refused")
        with pytest.raises(SystemExit) as info:
            train.main([cfg, f"--log.out_dir={run}", f"--train.init_from={base}", *short, change])
        err = capsys.readouterr().err
        assert info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
        assert "other parameter shapes" in err and named in err and not os.path.exists(run)
    # A path without checkpoints is one line too.
    os.makedirs(tmp_path / "empty")
    with pytest.raises(SystemExit):
        train.main([cfg, f"--log.out_dir={tmp_path / 'refused'}", f"--train.init_from={tmp_path / 'empty'}", *short])
    err = capsys.readouterr().err
    assert err.startswith("error: train.init_from") and err.count("\n") == 1, err

    # A run directory that has checkpoints of its own resumes from them: --resume wins over init_from.
    train.main([cfg, f"--log.out_dir={tuned}", f"--train.init_from={base}", *longer, "--resume",
                "--train.max_steps=3", "--train.warmup_steps=0", "--train.val_every=0"])
    out = capsys.readouterr().out
    assert newest(tuned)["step"] == 3 and "resuming at step 2" in out and "initialised from" not in out


def test_an_out_dir_that_holds_or_lies_in_init_from_is_refused_with_nothing_written(tmp_path, synthetic, capsys):
    """A fresh run from a checkpoint of its own log.out_dir (a run dir that kept only best.pt) would write its
    config.toml, metrics.jsonl and best.pt over the source's; a log.out_dir inside the init_from run would be
    written into that run. One line naming both, before the lock file or anything else is written."""
    cfg = small_config(tmp_path, synthetic)
    base = str(tmp_path / "base")
    train.main([cfg, f"--log.out_dir={base}", "--train.max_steps=2", "--train.warmup_steps=0"])
    for step in checkpoint.step_checkpoints(base):
        os.remove(step)
    best = checkpoint.best_path(base)

    def files():
        return {p: open(p, "rb").read() for p in glob.glob(os.path.join(tmp_path, "**"), recursive=True)
                if os.path.isfile(p)}
    for out, source, words in ((base, best, f"log.out_dir {base} contains train.init_from {best}"),
                               (os.path.join(base, "tuned"), base, f"log.out_dir {base}/tuned lies inside "
                                                                   f"train.init_from {base}")):
        before = files()
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            train.main([cfg, f"--log.out_dir={out}", f"--train.init_from={source}", "--train.max_steps=2"])
        err = capsys.readouterr().err
        assert info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
        assert words in err and "lie apart" in err, err
        assert files() == before
