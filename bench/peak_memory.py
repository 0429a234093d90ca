"""Peak memory of a block of code, for the benchmarks: CUDA's allocator statistics on a GPU; on CPU,
where torch keeps none, the resident-set high-water mark sampled every millisecond by a thread."""

import os
import sys
import threading
import time

import torch


def fixed_mmap_threshold():
    """Re-exec this script with glibc's mmap threshold fixed. glibc raises the threshold after large
    frees and then keeps freed blocks resident, which hides later peaks from the RSS sampler; a fixed
    threshold returns every large block to the system when it is freed."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
        os.execv(sys.executable, [sys.executable] + this_command() + sys.argv[1:])


def this_command():
    """The interpreter arguments that run the running benchmark again: `-m bench.NAME` (how they run, from the
    repository root), or the script's path where it was started as a file."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return ["-m", spec.name] if spec is not None else [sys.argv[0]]


class PeakMemory:
    """`with PeakMemory(device) as mem: ...` then `mem.bytes`: the peak above the level at entry."""

    def __init__(self, device="cpu"):
        self.cuda = torch.device(device).type == "cuda"

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self._rss()
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self._done.set()
            self._thread.join()
            self.bytes = max(self.peak, self._rss()) - self.base
