"""Make what the GPU check needs that a GPU machine may not be able to make, on any machine with the requirements
installed, before the run: the demo corpus's shards (`prepare_fineweb.py --source demo`, which reads the text
through `datasets` and tokenizes it with GPT-2's ranks). Nothing else on the run's path needs `datasets`, `wandb`,
GPT-2's ranks or a network (tests/test_gpu_check.py rehearses the run without them).

    python -m bench.gpu_check.prepare                      # -> data/gpu_check (~6 MiB, ~20 s)

Then bring data/gpu_check along with the repository (it is ignored by git, as all of data/ is);
`python -m bench.gpu_check` reads it there by default. Running it again keeps what is already made."""

import os
import sys

import prepare_fineweb
from bam.cli import Parser
from bench.gpu_check.common import DEMO_DATA, PREPARED_DIR, ROOT


def folder_size(folder):
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(folder) for name in names)


def main(argv=None):
    ap = Parser(prog="python -m bench.gpu_check.prepare", description=__doc__)
    ap.add_argument("--out_dir", default=PREPARED_DIR,
                    help=f"where to put it (default: {os.path.relpath(PREPARED_DIR, ROOT)}; the run's --data_dir is "
                         f"then OUT_DIR/demo)")
    args = ap.parse_args(argv)
    demo = os.path.join(args.out_dir, "demo") if args.out_dir != PREPARED_DIR else DEMO_DATA
    prepare_fineweb.main(["--source", "demo", "--out_dir", demo, "--workers", str(max(1, min(4, os.cpu_count() or 1)))])
    size = folder_size(args.out_dir) / 2**20
    shown = os.path.relpath(args.out_dir, ROOT) if os.path.abspath(args.out_dir).startswith(ROOT) else args.out_dir
    print(f"{shown}: {size:.1f} MiB; bring it along with the repository (the GPU machine's ignored folders may "
          f"hold 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
