"""Data pipeline benchmark: preparation throughput by worker count, and loader cost per batch.

    python -m bench.data_bench [--workers N] [--repeats 3]

Preparation: the offline demo corpus (Python's own documentation, ~1M GPT-2 tokens) repeated
--copies times, prepared end to end by prepare_fineweb.prepare (read with `datasets`, tokenised,
shards written) with one worker (in-process) and with N workers (a process pool), alternated in
the same run; best of --repeats. CPU seconds of the main process and of the workers show where the
time goes independently of what else the machine is running, and a calibration (pure CPU work
split over N processes) shows how much parallelism the machine offers at that moment.
Loader: ShardLoader.next_batch, one rank, on 10M-token shards and on the demo's 50k-token shards
(where many batches cross a shard boundary), for a few batch shapes.
"""

import json
import os
import platform
import resource
import shutil
import tempfile
import time

import numpy as np

import prepare_fineweb
from bam.cli import Parser, usable_cores
from bam.data import ShardLoader, write_shard
from bam.outputs import write_bytes
from bam.ranges import number
from bam.tokenizer import load_tokenizer


def bench_prepare(corpus_path, workers, repeats, tmp):
    """Per worker count, the fastest of `repeats` end-to-end preparations: (wall s, main-process
    CPU s, worker CPU s); and the token count."""
    best = {w: (float("inf"), 0.0, 0.0) for w in workers}
    tokens = 0
    for r in range(repeats):
        for w in workers:  # alternated, so background load on a shared machine hits both alike
            out = os.path.join(tmp, f"prep_w{w}_r{r}")
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu, t0 = time.process_time(), time.perf_counter()
            manifest = prepare_fineweb.prepare(prepare_fineweb.local_documents([corpus_path]), out,
                                               source={"kind": "bench"}, prefix="bench", shard_size=1_000_000,
                                               workers=w, progress=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            worker_cpu = max(0.0, after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime)
            if wall < best[w][0]:
                best[w] = (wall, cpu, worker_cpu)
            tokens = manifest["tokens"]
            shutil.rmtree(out)
    return best, tokens


def _spin(n):
    return sum(i * i for i in range(n))


def bench_machine_parallelism(workers, repeats, work=3_000_000):
    """Speedup of N processes over one on pure CPU work split N ways: the most any pool can get on
    this machine right now (below N when other jobs share the cores)."""
    best = {1: float("inf"), workers: float("inf")}
    for _ in range(repeats):
        for w in best:  # the same worker processes as preparation's (their start is timed for 1 and N alike)
            t0 = time.perf_counter()
            list(prepare_fineweb.parallel_map(_spin, [work // w] * w, w, chunk_size=1))
            best[w] = min(best[w], time.perf_counter() - t0)
    return best[1] / best[workers]


def bench_loader(data_dir, batch_size, seq_len, batches):
    loader = ShardLoader(data_dir, "train", batch_size, seq_len)
    loader.next_batch()  # warm the page cache for the first shard
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return (time.perf_counter() - t0) / batches * 1e3


def main():
    parser = Parser(prog="python -m bench.data_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=number(int, ">= 1, <= 1024"), default=usable_cores())
    parser.add_argument("--repeats", type=number(int, ">= 1, <= 1000"), default=3)
    parser.add_argument("--copies", type=number(int, ">= 1, <= 1000"), default=8,
                        help="the demo corpus repeated this many times, so the pool has enough work")
    args = parser.parse_args()
    load_tokenizer("gpt2")
    print(f"machine: {platform.processor() or platform.machine()}, {usable_cores()} cores "
          f"usable, python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        import datasets.config
        datasets.config.HF_DATASETS_CACHE = os.path.join(tmp, "hf_cache")  # its lock files go too
        corpus = os.path.join(tmp, "demo_corpus.jsonl")
        docs = prepare_fineweb.demo_documents(args.workers)
        write_bytes(corpus, ["".join(json.dumps({"text": d}) + "\n" for d in docs * args.copies).encode()])

        workers = sorted({1, args.workers})
        load = os.getloadavg()
        best, tokens = bench_prepare(corpus, workers, args.repeats, tmp)
        print(f"\npreparation, end to end: demo corpus x {args.copies} ({tokens:,} tokens, "
              f"{len(docs) * args.copies} documents), best of {args.repeats}, load average before "
              f"{load[0]:.2f} and after {os.getloadavg()[0]:.2f}:")
        print("| workers | wall s | tokens/s | speedup vs 1 worker | target (0.8 x N) | CPU s main | "
              "CPU s workers |")
        print("|---|---|---|---|---|---|---|")
        for w in workers:
            wall, cpu, worker_cpu = best[w]
            print(f"| {w} | {wall:.2f} | {tokens / wall:,.0f} | {best[1][0] / wall:.2f}x | {0.8 * w:.1f}x | "
                  f"{cpu:.2f} | {worker_cpu:.2f} |")
        print(f"\nthe machine right now: pure CPU work split over {args.workers} processes gets a "
              f"{bench_machine_parallelism(args.workers, args.repeats):.2f}x speedup over one process "
              f"(the ceiling for any pool at this moment; {args.workers}x on idle cores)")

        big = os.path.join(tmp, "big")
        rng = np.random.default_rng(0)
        for i in range(3):
            write_shard(os.path.join(big, f"bench_train_{i + 1:06d}.bin"), rng.integers(0, 50257, 10_000_000))
        demo_small = os.path.join(tmp, "demo_small")
        prepare_fineweb.prepare(docs, demo_small, source={"kind": "bench"}, prefix="demo", shard_size=50_000,
                                workers=args.workers, progress=False)
        print("\nloader: ShardLoader.next_batch -> (x, y, doc_ids) int64 CPU tensors, one rank")
        print("| shards | batch (B x T) | ms per batch |")
        print("|---|---|---|")
        for name, directory in (("3 x 10M tokens (random ids)", big), ("demo, 50k-token shards", demo_small)):
            for batch_size, seq_len in ((8, 1024), (32, 1024), (8, 4096)):
                ms = bench_loader(directory, batch_size, seq_len, batches=200)
                print(f"| {name} | {batch_size} x {seq_len} | {ms:.3f} |")


if __name__ == "__main__":
    main()
