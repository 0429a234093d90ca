"""
Checks bam/sizing.py (train.py --dry_run) against measured memory: one training step (forward, backward, AdamW)
of two small models on the CPU, with and without activation checkpointing, under torch's MemTracker, which
follows every tensor's bytes and says what each one is (parameter, gradient, optimizer state, activation,
temporary). Printed: the measured peak of activations + temporaries next to sizing.activation_bytes, and the
measured weights, gradients and optimizer state next to sizing.static_bytes.

    python -m bench.train_memory

The models use RoPE without SSMax or document masks, so that the CPU runs the flash kernel of
scaled_dot_product_attention (O(T) memory, as FlexAttention on a GPU), and float32 (b = 4 bytes).
Results: docs/benchmarks.md.
"""

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from bam.cli import Parser
from bam.parallel import checkpoint_blocks
from bam.sizing import Sizes, activation_bytes, static_bytes
from model import ModelConfig, Transformer

SHAPES = {  # (model, batch): the first is dominated by its output layer, the second by its Blocks
    "4 x 128, GPT-2 vocab, 8 x 128 tokens": (dict(n_layer=4, n_embd=128, n_head=4, block_size=128), 8),
    "8 x 256, vocab 2048, 8 x 512 tokens": (dict(n_layer=8, n_embd=256, n_head=4, block_size=512, vocab_size=2048), 8),
}
MiB = 2**20


def measure(model_config, batch, checkpointing):
    """(peak activations + temporaries, weights + gradients + optimizer state) in bytes, of the second step."""
    torch.manual_seed(0)
    model = Transformer(model_config)
    if checkpointing == "full":
        checkpoint_blocks(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    T, V = model_config.block_size, model_config.vocab_size
    x, y = torch.randint(0, V, (batch, T)), torch.randint(0, V, (batch, T))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(2):  # the first allocates the optimizer state; the second is measured
            if step == 1:
                tracker.reset_mod_stats()
            model(x, y)[1].backward()
            optimizer.step()
            if step == 1:
                held = by_kind(next(iter(tracker.get_tracker_snapshot("current").values())))
            optimizer.zero_grad(set_to_none=True)
    # The root module's peaks during its forward and its backward: what is alive then besides the weights,
    # gradients and optimizer state (activations, and the temporaries of the backward).
    peaks = tracker.memory_tracking[model].snapshots
    activations = max(kinds["activation"] + kinds["temp"] for state in ("Peak-Forward", "Peak-Backward")
                      for snapshot in peaks[next(k for k in peaks if k.value == state)]
                      for kinds in [by_kind(next(iter(snapshot.values())))])
    return activations, held["parameter"] + held["gradient"] + held["optstate"]


def by_kind(snapshot):
    return {(kind.value if hasattr(kind, "value") else kind).lower(): n for kind, n in snapshot.items()}


def main():
    Parser(prog="python -m bench.train_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"{'shape':<40} {'AC':<5} {'activations MiB: measured':>26} {'estimated':>10} {'ratio':>6}   "
          f"{'weights+grads+optimizer MiB: measured':>38} {'estimated':>10}")
    for name, (shape, batch) in SHAPES.items():
        cfg = ModelConfig(pe="rope", ssmax=False, attn_impl="sdpa", **shape)
        static_estimate = sum(v for k, v in static_bytes(Sizes.of(cfg), "fsdp", 1, bf16=False).items()
                              if k != "buffers")
        for checkpointing in ("none", "full"):
            measured, static = measure(cfg, batch, checkpointing)
            estimate = activation_bytes(cfg, batch * cfg.block_size, bf16=False, checkpointing=checkpointing)
            print(f"{name:<40} {checkpointing:<5} {measured / MiB:>26.1f} {estimate / MiB:>10.1f} "
                  f"{estimate / measured:>6.2f}   {static / MiB:>38.1f} {static_estimate / MiB:>10.1f}")


if __name__ == "__main__":
    main()
