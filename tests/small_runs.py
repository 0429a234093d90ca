"""The small training runs the CPU tests share: a config for a 2-layer model whose step takes a few ms, and
readers of what a run leaves behind (metrics rows, the newest checkpoint). The synthetic shards they train on
are the `synthetic` fixture of tests/conftest.py.

Used by test_drope.py, test_fsdp.py, test_io_errors.py, test_robustness.py, test_tokenizer.py and
test_train.py (tests/test_structure.py holds this list to the imports)."""

import glob
import json
import os
import textwrap

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCUM = 2  # micro-batches per step in one process (tokens_per_step = 2 x batch 2 x 32)


def small_config(tmp_path, data_dir):
    """The path of a TOML config (written into tmp_path) that trains a 2-layer BAM + SSMax model, small enough
    that a step takes a few ms, on the shards in data_dir. A test changes it as a user would, by
    --section.key=value overrides after the path."""
    path = tmp_path / "small.toml"
    path.write_text(textwrap.dedent(f"""\
        [model]
        n_layer = 2
        n_embd = 32
        n_head = 4
        block_size = 32
        ssmax = true
        [data]
        data_dir = "{data_dir}"
        batch_size = 2
        [train]
        tokens_per_step = {ACCUM * 2 * 32}
        max_steps = 6
        prior_lr = 2e-3
        warmup_steps = 2
        val_every = 3
        val_tokens = 256
        ckpt_every = 1
        keep_last = 2
        compile = false
        dtype = "float32"
        [log]
        log_every = 1
        """))
    return str(path)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def newest(run_dir):
    return torch.load(sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*.pt")))[-1], weights_only=True)
