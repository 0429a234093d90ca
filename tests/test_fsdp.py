"""train.parallel = "fsdp" (bam/parallel.py) on CPU with gloo and real torchrun: FSDP2 against DDP and one process
with accumulation, preemption and a kill -9 in the middle of a sharded checkpoint with an exact resume,
resuming on another number of ranks and from/into DDP, a sharded run read by every consumer of checkpoints,
two torchrun launchers rendezvousing as two nodes, activation checkpointing, per-Block compile, the bf16 policy,
and the dry run's memory plan against measured memory.

Launches of torchrun cost ~10 s each on two cores, so the two reference runs (FSDP and DDP on two ranks) are
made once per module, and what can run on a world of one rank runs inside this process."""

import errno
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import train
from bam import checkpoint, cli, parallel
from bam.checkpoint import load_model
from bam.config import TrainConfig, load_config
from model import ENCODINGS, ModelConfig, Transformer
from small_runs import ROOT, rows, small_config
from tiny_models import batch, relative_error, tiny_config, tiny_model

pytestmark = pytest.mark.slow  # torchrun launches, process groups and per-Block compiles

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # two workers share the cores
FSDP = ["--train.parallel=fsdp"]
STEP = ["--train.tokens_per_step=256"]  # 2 micro-batches a step on each of 2 ranks, 4 in one process


def torchrun(args, launcher=("--standalone", "--nproc_per_node=2"), script="train.py", check=True, **kwargs):
    proc = subprocess.run([*TORCHRUN, *launcher, script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300, **kwargs)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def weights(run_dir):
    """The newest checkpoint's weights, whole, whichever kind it is."""
    return checkpoint.load_checkpoint(run_dir)[1]["model"]


def comparable(run_dir):  # every metric but the wall clock
    return [{k: v for k, v in row.items() if k not in ("tokens_per_s",)} for row in rows(run_dir)]


@pytest.fixture(scope="module")
def config(tmp_path_factory, synthetic):
    return small_config(tmp_path_factory.mktemp("config"), synthetic)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory, config):
    """FSDP on two ranks, 2 accumulation steps each, 6 steps: the run the others are held to."""
    run = str(tmp_path_factory.mktemp("fsdp2") / "run")
    torchrun([config, f"--log.out_dir={run}", *STEP, *FSDP])
    return run


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory, config):
    run = str(tmp_path_factory.mktemp("ddp2") / "run")
    torchrun([config, f"--log.out_dir={run}", *STEP])
    return run


@pytest.fixture
def one_rank():
    """What train.main does for FSDP without torchrun, for tests that build sharded models themselves."""
    procs = train.setup_processes()
    parallel.init_distributed(procs, "fsdp")
    yield procs
    dist.destroy_process_group()


def test_fsdp_equals_ddp_on_the_same_micro_batches_and_one_process_with_accumulation(fsdp2, ddp2, config, tmp_path):
    # The sharded run's layout: step folders written whole (DONE last), the last keep_last = 2, best/ apart.
    names = sorted(os.listdir(os.path.join(fsdp2, "checkpoints")))
    assert names == ["best", "step_00000005", "step_00000006"]
    folder = checkpoint.step_path(fsdp2, 6, sharded=True)
    files = set(os.listdir(folder))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "state.json", "DONE"} == files  # one shard file per rank
    state = json.load(open(os.path.join(folder, "state.json")))
    assert state["step"] == 6 and len(state["rng_per_rank"]) == 2 and state["loader"]["position"] == 6 * 256
    assert state["config"]["train"]["parallel"] == "fsdp"

    # The same micro-batches on the same two ranks: FSDP reduce-scatters after each micro-batch where DDP
    # all-reduces once, so sums run in another order: measured 3.5e-9 relative (bitwise with fsdp_grad_sync
    # = "step", which accumulates as DDP does).
    assert relative_error(weights(fsdp2), weights(ddp2), norm="l2") < 1e-6
    for a, b in zip(rows(fsdp2), rows(ddp2)):
        assert a["step"] == b["step"]
        for key in ("loss", "val_loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
        if "grad_norm" in a:
            # The global norm summed from shards: both are within fp32 rounding of the exact norm (~4e-6 here,
            # from the 2048-row embedding's gradient), in different directions.
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=2e-5)
        # every head's prior, logged whole from the shards (each rank holds half of the heads' values)
        assert a["prior"].keys() == b["prior"].keys() >= {"bam_shape", "bam_log_scale", "ssmax_scale"}
        for kind in a["prior"]:
            assert torch.tensor(a["prior"][kind]).shape == (2, 4)
            assert torch.allclose(torch.tensor(a["prior"][kind]), torch.tensor(b["prior"][kind]), rtol=1e-5)

    # One process, 4 accumulation steps of the same micro-batches: the same step, summed in another order.
    single = str(tmp_path / "single")
    train.main([config, f"--log.out_dir={single}", *STEP])
    assert relative_error(weights(fsdp2), weights(single), norm="l2") < 1e-5


SCRIPT = """
import os, signal, sys, time
from bam import checkpoint, outputs
import train
SIGNALS, STOP_RANK, KILL_AT = {signals}, {rank}, {kill_at}
log_step, write_text = train.log_step, outputs.write_text

def log_step_then_signal(run, *args, **kwargs):
    row = log_step(run, *args, **kwargs)
    if run.procs.rank == STOP_RANK:
        for signum in SIGNALS.get(row["step"], []):
            os.kill(os.getpid(), signum)
    return row

def kill_job():  # kill -9 of torchrun and every worker it started, as a node failure would end the job
    agent = os.getppid()
    workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
               and open(f"/proc/{{p}}/stat").read().rsplit(")", 1)[1].split()[1] == str(agent)]
    for pid in [agent, *workers, os.getpid()]:
        os.kill(pid, signal.SIGKILL)

def dying_write_text(path, text):
    # Rank 0 writes state.json once every rank's shards are on disk, before DONE and the rename.
    if f"step_{{KILL_AT:08d}}.tmp-" in path and path.endswith("state.json"):
        kill_job()
    return write_text(path, text)

train.log_step, outputs.write_text = log_step_then_signal, dying_write_text
train.main(sys.argv[1:])
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_preemption_a_kill_9_mid_checkpoint_and_a_resume_on_two_nodes_equal_the_uninterrupted_run(fsdp2, config,
                                                                                                    tmp_path):
    run = str(tmp_path / "run")
    args = [config, f"--log.out_dir={run}", *STEP, *FSDP, "--train.ckpt_every=2"]
    script = tmp_path / "script.py"

    def launch(*extra, signals=None, rank=0, kill_at=-1):
        script.write_text(SCRIPT.format(signals=signals or {}, rank=rank, kill_at=kill_at))
        return torchrun([*args, *extra], script=str(script), check=False)

    # SIGTERM to rank 1 alone after step 2: every rank finishes step 3, which every rank checkpoints.
    proc = launch(signals={2: [int(signal.SIGTERM)]}, rank=1)
    assert proc.returncode != 0 and proc.stderr.count("stopped at step 3 on a signal to another rank") == 1, \
        proc.stderr[-3000:]
    # the checkpoint it names is the folder every rank wrote, not a .pt file
    assert f"{checkpoint.step_path(run, 3, sharded=True)} holds it" in proc.stderr
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.step_checkpoints(run)] == [2, 3]

    # Resumed, then killed (SIGKILL to torchrun and both workers) while step 4's folder is being written.
    proc = launch("--resume", kill_at=4)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    [torn] = glob.glob(os.path.join(run, "checkpoints", "step_00000004.tmp-*"))
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(torn)) and "DONE" not in os.listdir(torn)
    with pytest.raises(cli.UserError, match=r"is an unfinished save \(the temp folder of a checkpoint write that was "
                                            r"killed, never read\)"):
        checkpoint.main([torn, str(tmp_path / "torn.pt")])  # not a run directory with no checkpoint
    assert [checkpoint.checkpoint_step(p) for p in checkpoint.step_checkpoints(run)] == [2, 3]  # not a checkpoint
    assert load_model(run).config.n_layer == 2  # a reader meanwhile takes step 3, whole

    # The rest on two launchers of one rank each, joined by torchrun's own rendezvous (c10d) as two nodes are.
    launcher = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                "--rdzv_id=test"]
    script.write_text(SCRIPT.format(signals={}, rank=0, kill_at=-1))
    nodes = [subprocess.Popen([*TORCHRUN, *launcher, str(script), *args, "--resume"], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert sum("2 x 32 x 2 ranks x 2 accumulation steps" in out for out, _ in outputs) == 1  # rank 0, on one node
    assert not glob.glob(os.path.join(run, "checkpoints", "*.tmp-*"))  # the torn folder was cleared
    assert comparable(run) == comparable(fsdp2)  # losses, val losses, grad norms, priors: bit for bit
    a, b = weights(run), weights(fsdp2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    moments = [checkpoint.load_checkpoint(r, optimizer=True)[1]["optimizer"]["state"] for r in (run, fsdp2)]
    assert all(torch.equal(moments[0][i][k], moments[1][i][k]) for i in moments[0] for k in moments[0][i])


def test_resume_on_another_number_of_ranks_and_between_ddp_and_fsdp(fsdp2, ddp2, config, tmp_path, capsys):
    """DCP reshards a two-rank checkpoint for one rank; a sharded checkpoint resumes a DDP run and a .pt one an
    FSDP run. The loader's position is in tokens, so every step reads the same tokens as before, split over
    other ranks and micro-batches: the result differs only by the order of sums."""
    def copy_until_step_5(source, name):
        run = str(tmp_path / name)
        shutil.copytree(source, run)
        for path in checkpoint.step_checkpoints(run)[1:]:  # keep step 5
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return run

    for source, name, parallelism in ((fsdp2, "fsdp_on_one", FSDP), (fsdp2, "fsdp_as_ddp", []),
                                      (ddp2, "ddp_as_fsdp", FSDP)):
        run = copy_until_step_5(source, name)
        capsys.readouterr()
        train.main([config, f"--log.out_dir={run}", "--resume", *STEP, *parallelism])
        out = capsys.readouterr().out
        assert "resuming at step 5" in out, out
        assert ("train.parallel: 'fsdp' -> 'ddp'" in out) == (name == "fsdp_as_ddp")
        assert relative_error(weights(run), weights(source), norm="l2") < 1e-6, name
        assert [r["step"] for r in rows(run)] == [r["step"] for r in rows(source)]


def copy_until_step(source, run, step):
    """A copy of the run `source` whose newest checkpoint is `step`'s."""
    shutil.copytree(source, run)
    for path in checkpoint.step_checkpoints(run):
        if checkpoint.checkpoint_step(path) > step:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return run


def test_a_damaged_newest_folder_is_set_aside_and_every_reader_takes_the_complete_copy(fsdp2, config, tmp_path,
                                                                                       capsys):
    """An FSDP run whose newest step folder lost its .metadata, resumed as DDP: the resume falls back to the step
    before, sets the damaged folder aside (it would otherwise sit beside the new step_X.pt of the same step, and
    a reader could take it), and every reader then takes the complete copy."""
    run = shutil.copytree(fsdp2, str(tmp_path / "run"))
    damaged = checkpoint.step_checkpoints(run)[-1]
    os.remove(os.path.join(damaged, ".metadata"))
    capsys.readouterr()
    train.main([config, f"--log.out_dir={run}", "--resume", *STEP])
    out = capsys.readouterr().out
    assert f"warning: cannot load {damaged} (incomplete: .metadata is missing); trying the one before it" in out
    assert f"warning: {damaged} set aside as {os.path.basename(damaged)}.damaged" in out
    assert os.path.isdir(damaged + ".damaged") and not os.path.exists(damaged)
    newest = checkpoint.step_path(run, checkpoint.checkpoint_step(damaged))
    assert checkpoint.find_checkpoint(run) == newest and os.path.isfile(newest)
    checkpoint.main([run, str(tmp_path / "out.pt")])  # python -m bam.checkpoint RUN OUT.pt
    assert f"{newest} -> " in capsys.readouterr().out


def test_a_checkpoint_whose_metadata_is_zeros_is_one_line_without_torchs_tracebacks(fsdp2, config, tmp_path,
                                                                                    capfd, caplog):
    """Same size, so DONE still matches: the load fails inside torch.distributed.checkpoint, whose own logging
    must not print its tracebacks before the project's one line."""
    run = shutil.copytree(fsdp2, str(tmp_path / "run"))
    newest = checkpoint.step_checkpoints(run)[-1]
    metadata = os.path.join(newest, ".metadata")
    size = os.path.getsize(metadata)
    with open(metadata, "wb") as f:
        f.write(bytes(size))
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.run_cli(train.main, [config, f"--log.out_dir={run}", "--resume", *STEP, *FSDP])
    err = capfd.readouterr().err
    assert stop.value.code == 1
    # DCP logs on the root logger, which pytest captures; outside pytest each record is a traceback on stderr
    assert not [r for r in caplog.records if "distributed/checkpoint" in r.pathname.replace(os.sep, "/")]
    assert [line for line in err.splitlines() if line.strip()] == [
        line for line in err.splitlines() if line.startswith("error: cannot load the checkpoint")], err[-3000:]


def test_a_sharded_checkpoint_pruned_during_the_read_is_read_again_or_named_as_removed(fsdp2, tmp_path, monkeypatch,
                                                                                         capsys):
    """An evaluator reads a live FSDP run: once it has the newest folder's state.json, the trainer saves two more
    steps and keep_last = 2 removes the folder (DCP's read of it then fails). The reader takes the newest complete
    folder, saying so in one line; a folder named itself says that it was removed, not that it is incomplete."""
    from eval.loading import load_for_eval
    from eval.options import EvalOptions

    run = shutil.copytree(fsdp2, str(tmp_path / "run"))
    chosen = checkpoint.step_path(run, 6, sharded=True)
    newest = checkpoint.step_path(run, 8, sharded=True)
    want = checkpoint.load_checkpoint(chosen)[1]["model"]
    real = checkpoint.check_sharded

    def trainer_prunes_after_the_state_is_read(path):
        state = real(path)
        if path == chosen and os.path.isdir(chosen):
            for step in (7, 8):  # the same shards under newer names: a whole folder each, as save_sharded leaves it
                shutil.copytree(chosen, checkpoint.step_path(run, step, sharded=True))
            checkpoint.keep_last(run, 2)
        return state
    monkeypatch.setattr(checkpoint, "check_sharded", trainer_prunes_after_the_state_is_read)
    capsys.readouterr()
    evaluated = load_for_eval(run, EvalOptions(device="cpu"))
    assert evaluated.info["checkpoint"] == newest and not os.path.exists(chosen)
    assert all(torch.equal(t, want[name]) for name, t in evaluated.model.state_dict().items())
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {chosen} was removed during the read (a training run's keep_last or its next save); reading "
        f"the newest checkpoint of {run} again"]

    def removed_after_the_state_is_read(path):
        state = real(path)
        shutil.rmtree(path)
        return state
    monkeypatch.setattr(checkpoint, "check_sharded", removed_after_the_state_is_read)
    with pytest.raises(SystemExit) as info:
        cli.run_cli(checkpoint.main, [newest, str(tmp_path / "out.pt")])  # python -m bam.checkpoint FOLDER OUT.pt
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.splitlines() == [
        f"error: {newest} was removed during the read (a training run's keep_last prunes its older checkpoints); "
        "give the run directory to read its newest checkpoint"], err
    assert not os.path.exists(tmp_path / "out.pt")


def limit_file_size(limit):
    def set_limit():
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return set_limit


def test_a_full_disk_in_an_fsdp_checkpoint_is_one_line_from_rank_0_and_the_step_before_is_intact(fsdp2, config,
                                                                                                 tmp_path):
    """A resume under a file-size limit smaller than one rank's shard: torch.save inside DCP's writer fails
    (its RuntimeError "unexpected pos" on the rank that met it); every rank stops with the one line, which
    rank 0 alone prints, and the checkpoint before is untouched and resumes."""
    run = copy_until_step(fsdp2, str(tmp_path / "run"), 5)
    before = {name: os.path.getsize(os.path.join(run, "checkpoints", "step_00000005", name))
              for name in os.listdir(os.path.join(run, "checkpoints", "step_00000005"))}
    proc = torchrun([config, f"--log.out_dir={run}", "--resume", *STEP, *FSDP], check=False,
                    preexec_fn=limit_file_size(1 << 20))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # step 6 validates first, so the first sharded folder it writes is best/, then step_00000006/
    folder = f"({checkpoint.best_path(run, sharded=True)}|{checkpoint.step_path(run, 6, sharded=True)})"
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-4000:]
    assert re.fullmatch(re.escape("error: cannot write ") + folder + re.escape(
        f": {cli.OS_REASONS[errno.EFBIG]}; the previous checkpoint {checkpoint.step_path(run, 5, sharded=True)} is "
        "intact; make room and rerun with --resume"), errors[0]), errors
    assert "unexpected pos" not in proc.stderr and "RuntimeError" not in proc.stderr, proc.stderr[-4000:]
    assert {name: os.path.getsize(os.path.join(run, "checkpoints", "step_00000005", name))
            for name in os.listdir(os.path.join(run, "checkpoints", "step_00000005"))} == before
    torchrun([config, f"--log.out_dir={run}", "--resume", *STEP, *FSDP])  # without the limit: the step is made
    assert comparable(run) == comparable(fsdp2)


def test_a_sharded_run_is_evaluated_exported_converted_and_fine_tuned_like_a_ddp_run(fsdp2, config, tmp_path,
                                                                                       capsys):
    from safetensors.torch import load_file

    import export_hf
    from eval.passkey import evaluate_passkey

    whole = weights(fsdp2)
    assert load_model(fsdp2).state_dict().keys() == whole.keys()
    from eval.loading import output_dir
    from eval.options import EvalOptions

    folder = checkpoint.step_path(fsdp2, 6, sharded=True)  # given itself, a folder is a checkpoint, not a run:
    assert output_dir(folder) == os.path.join(os.path.dirname(folder), "eval", "step_00000006")  # results beside it
    options = EvalOptions(out=str(tmp_path / "eval"), progress=False, verbose=False)
    results = evaluate_passkey(fsdp2, options=options, lengths="96", samples=2)
    assert results["model"]["checkpoint"].endswith("step_00000006") and len(results["results"]) == 1

    export_hf.main([fsdp2, str(tmp_path / "hf")])
    [shard] = glob.glob(str(tmp_path / "hf" / "*.safetensors"))
    exported = load_file(shard)
    assert all(torch.equal(exported[k].float(), v) for k, v in whole.items() if k in exported) and exported

    # One .pt file in a DDP run's layout, read with weights_only=True (nothing needs it; it is for copying).
    out = str(tmp_path / "step6.pt")
    capsys.readouterr()
    checkpoint.main([fsdp2, out])  # python -m bam.checkpoint RUN OUT.pt
    assert "step_00000006 -> " in capsys.readouterr().out
    converted = torch.load(out, weights_only=True)
    assert all(torch.equal(converted["model"][k], v) for k, v in whole.items())
    assert sorted(converted["optimizer"]["state"]) == list(range(len(converted["optimizer"]["state"])))
    assert converted["step"] == 6 and converted["rng"]["python"]

    tuned = str(tmp_path / "tuned")
    capsys.readouterr()
    train.main([config, f"--log.out_dir={tuned}", f"--train.init_from={fsdp2}", "--train.max_steps=1",
                "--train.warmup_steps=0", "--train.val_every=0"])
    assert f"initialised from {checkpoint.step_path(fsdp2, 6, sharded=True)} (step 6)" in capsys.readouterr().out


SHARDED = dict(n_layer=3, ssmax=True, attn_impl="sdpa")  # a Block per rank and one more, trained on sdpa


def loss_and_gradients(model, steps=1):
    for seed in range(steps):
        x, doc_ids = batch(T=64, seed=seed)
        loss = model(x, torch.roll(x, -1, 1), doc_ids=doc_ids)[1]
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()
             if p.requires_grad}  # BAM's location is frozen
    grads = {k: g.full_tensor() if isinstance(g, dist.tensor.DTensor) else g for k, g in grads.items()}
    return loss.detach(), grads


@pytest.mark.parametrize("pe", ["bam", "rope"])
def test_activation_checkpointing_leaves_loss_and_gradients_unchanged(pe, one_rank):
    """Full AC recomputes each Block's forward in the backward: the same operations on the same numbers."""
    results = {}
    for parallelism in ("ddp", "fsdp"):
        for ac in ("none", "full"):
            model = tiny_model(pe=pe, **SHARDED)
            t = TrainConfig(parallel=parallelism, activation_checkpointing=ac, compile=False)
            parallel.prepare(model, t, one_rank, bf16=False)
            results[parallelism, ac] = loss_and_gradients(model)
            if ac == "full":
                assert "CheckpointWrapper" in type(model.blocks[0]).__name__  # FSDP renames it FSDPCheckpointWrapper
    for parallelism in ("ddp", "fsdp"):
        (loss, grads), (loss_ac, grads_ac) = results[parallelism, "none"], results[parallelism, "full"]
        assert torch.equal(loss, loss_ac)
        assert grads.keys() == grads_ac.keys() and all(torch.equal(grads[k], grads_ac[k]) for k in grads)
    assert torch.equal(results["ddp", "none"][0], results["fsdp", "full"][0])  # one rank: FSDP computes the same


@pytest.mark.parametrize("ssmax", [False, True])
def test_fire_is_sharded_and_computes_what_it_computes_unsharded(ssmax, one_rank):
    """fully_shard refuses a 0-d parameter ("Change log_c to a 1D tensor"), which FIRE's log c and log L were."""
    whole = tiny_model(**{**SHARDED, "pe": "fire", "ssmax": ssmax})
    sharded = tiny_model(**{**SHARDED, "pe": "fire", "ssmax": ssmax})
    sharded.load_state_dict(whole.state_dict())
    parallel.prepare(sharded, TrainConfig(parallel="fsdp", compile=False), one_rank, bf16=False)
    (loss, grads), (loss_sharded, grads_sharded) = loss_and_gradients(whole), loss_and_gradients(sharded)
    assert torch.equal(loss, loss_sharded)
    assert grads.keys() == grads_sharded.keys() and grads["priors.0.log_c"].shape == (1,)
    # 1e-5, not tighter: with two threads the unsharded model's own FIRE gradients differ from one backward to
    # the next by up to 1.6e-6 (the CPU's parallel accumulation into the MLP's few parameters)
    assert relative_error(grads_sharded, grads, norm="l2") < 1e-5


def test_sinks_and_gates_are_sharded_and_compute_what_they_compute_unsharded(one_rank):
    """The sinks' logits (shape (n_head,): fully_shard refuses 0-d) and the gates' projections are sharded with
    their Block; the sharded model's loss, gradients and logged sink values are the unsharded model's."""
    whole = tiny_model(attn_sink=True, attn_gate=True, **SHARDED)
    with torch.no_grad():
        for block in whole.blocks:
            block.attn.sink_logit.copy_(torch.linspace(-1.0, 2.0, 4))
    sharded = tiny_model(attn_sink=True, attn_gate=True, **SHARDED)
    sharded.load_state_dict(whole.state_dict())
    parallel.prepare(sharded, TrainConfig(parallel="fsdp", compile=False), one_rank, bf16=False)
    assert isinstance(sharded.blocks[0].attn.sink_logit, dist.tensor.DTensor)
    (loss, grads), (loss_sharded, grads_sharded) = loss_and_gradients(whole), loss_and_gradients(sharded)
    assert torch.equal(loss, loss_sharded)
    assert grads.keys() == grads_sharded.keys() and grads["blocks.0.attn.sink_logit"].shape == (4,)
    assert {"blocks.0.attn.wg.weight", "blocks.2.attn.sink_logit"} <= set(grads)
    assert relative_error(grads_sharded, grads, norm="l2") < 1e-5
    assert parallel.prior_summary(sharded)["sink_logit"] == whole.prior_summary()["sink_logit"]


def test_per_block_compile_under_fsdp_matches_eager(one_rank):
    """AC, then torch.compile of each Block, then fully_shard, as torchtitan orders them (aot_eager: dynamo and
    AOT autograd trace forward and backward as on a GPU, without inductor's minutes of C++ on a CPU)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() leaves the counters of earlier tests
    eager, compiled = tiny_model(**SHARDED), tiny_model(**SHARDED)
    t = TrainConfig(parallel="fsdp", activation_checkpointing="full", compile=True)
    parallel.prepare(compiled, t, one_rank, bf16=False, compile_backend="aot_eager")
    (loss, grads), (loss_c, grads_c) = loss_and_gradients(eager, steps=2), loss_and_gradients(compiled, steps=2)
    assert loss_c == pytest.approx(loss.item(), rel=1e-6)
    assert relative_error(grads_c, grads, norm="l2") < 1e-5
    # one graph serves every Block (each has its own prior module and layer index)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_bf16_policy_stays_within_its_tolerance(config, tmp_path):
    """train.dtype = bfloat16 under FSDP is MixedPrecisionPolicy(bf16 compute, fp32 reduction and weights). After
    3 steps its losses are within 0.02 nats of fp32's and as close as DDP's bf16 autocast (same order of
    rounding); it differs from fp32 at all, so it did run in bf16."""
    losses = {}
    for name, extra in (("fp32", FSDP), ("policy", [*FSDP, "--train.dtype=bfloat16"]),
                        ("autocast", ["--train.dtype=bfloat16"])):
        run = str(tmp_path / name)
        train.main([config, f"--log.out_dir={run}", "--train.max_steps=3", "--train.val_every=0", *extra])
        losses[name] = [r["loss"] for r in rows(run)]
    policy = max(abs(a - b) for a, b in zip(losses["policy"], losses["fp32"]))
    autocast = max(abs(a - b) for a, b in zip(losses["autocast"], losses["fp32"]))
    assert 0 < policy < 0.02 and policy < 3 * autocast + 1e-3, (policy, autocast)


def test_dry_run_prints_the_memory_plan(capsys):
    """--dry_run builds nothing but a meta model: the 7B size's plan at 8 and 64 GPUs, checked against a count
    of its parameters from the shapes alone."""
    train.main(["configs/paper/sizes/bam_ssmax_512_7b.toml", "--dry_run", "--world_size=8,64"])
    out = capsys.readouterr().out
    m = load_config("configs/paper/sizes/bam_ssmax_512_7b.toml").model
    C, F, L, V, H = m.n_embd, m.hidden_dim, m.n_layer, m.vocab_size, m.n_head
    per_block = 4 * C * C + 3 * C * F + 2 * C + H  # q, k, v, o; SwiGLU; two norms; SSMax's scales
    params = L * per_block + 2 * V * C + C + 3 * H * L  # blocks, embedding, head, final norm, BAM (shape, scale, loc)
    assert f"({params:,})" in out
    table = {(line.split()[0], int(line.split()[1])): [float(v) for v in line.split()[2:]]
             for line in out.splitlines() if line.startswith(("  ddp", "  fsdp"))}
    assert set(table) == {("ddp", 8), ("fsdp", 8), ("ddp", 64), ("fsdp", 64)}
    for world, rows_per_rank in ((8, 16), (64, 9)):  # 64 x 16 x 512 tokens exceed a step: the largest batch that fits
        ddp, fsdp = table["ddp", world], table["fsdp", world]
        assert ddp[:2] == fsdp[:2] == [rows_per_rank, 589_824 // (rows_per_rank * 512 * world)]
        assert ddp[2] == pytest.approx(4 * params / 2**30, abs=0.01)  # fp32 weights, whole on every rank
        assert fsdp[2] == pytest.approx(4 * params / world / 2**30, abs=0.01)  # a 1/world shard
        assert fsdp[4] == pytest.approx(8 * params / world / 2**30, abs=0.01)  # AdamW's two moments, sharded
        assert fsdp[8] < fsdp[7] < ddp[7]  # activation checkpointing and sharding both lower the peak
    with pytest.raises(SystemExit):
        train.main(["configs/tiny.toml", "--dry_run", "--world_size=eight"])
    assert capsys.readouterr().err.startswith("error: --world_size=eight: give numbers of GPUs")


def test_a_dry_run_of_100000_layers_is_planned_per_distinct_layer():
    """The plan counts one Block and one prior module and multiplies them (building 100,000 Blocks, even on the
    meta device, took minutes): the same counts as the whole model built, for every encoding, and 100,000 layers
    planned in the time of one, their parameters those of the shapes alone."""
    from bam.sizing import Sizes

    def built(mc):  # what Sizes.of counted before: the whole model, every layer of it
        with torch.device("meta"):
            model = Transformer(mc)
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        blocks = [count(b) for b in model.blocks]
        return Sizes(total=count(model), blocks=sum(blocks), largest_block=max(blocks),
                     embedding=count(model.tok_emb), head=count(model.norm) + count(model.lm_head),
                     priors=sum(count(p) for p in model.priors))

    for pe in ENCODINGS:
        for extra in (dict(ssmax=True, n_kv_head=2), dict(bam_per_layer=False)):
            mc = tiny_config(n_layer=3, pe=pe, **extra)
            assert Sizes.of(mc) == built(mc), (pe, extra)

    proc = subprocess.run([sys.executable, "train.py", "configs/tiny.toml", "--dry_run", "--model.n_layer=100000",
                           "--world_size=8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = load_config("configs/tiny.toml", ["--model.n_layer=100000"]).model
    C, F, L, V, H = m.n_embd, m.hidden_dim, m.n_layer, m.vocab_size, m.n_head
    params = L * (4 * C * C + 3 * C * F + 2 * C + H) + 2 * V * C + C + 3 * H * L  # as in the test above
    assert f"({params:,}): 100000 Blocks of" in proc.stdout, proc.stdout[:500]


def test_the_activation_estimate_matches_measured_memory():
    """sizing.activation_bytes against torch's MemTracker on one step of a model whose Blocks dominate (the
    bench script checks two shapes, docs/benchmarks.md), with and without activation checkpointing."""
    from bam.sizing import activation_bytes
    from bench.train_memory import measure

    cfg = ModelConfig(n_layer=4, n_embd=128, n_head=4, block_size=256, vocab_size=1024, pe="rope", attn_impl="sdpa")
    for ac in ("none", "full"):
        measured, _ = measure(cfg, 4, ac)
        assert activation_bytes(cfg, 4 * 256, bf16=False, checkpointing=ac) == pytest.approx(measured, rel=0.1), ac
