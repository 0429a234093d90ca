"""python -m bench.gpu_check: the GPU acceptance run (docs/benchmarks.md, "GPU check").

    python -m bench.gpu_check.prepare                                    # once, on any machine: data/gpu_check
    python -m bench.gpu_check --plan                                     # the plan, with every case's seconds
    python -m bench.gpu_check --out OUT                                  # one GPU: the acceptance run, < 8 min
    python -m bench.gpu_check --out OUT --sections correctness --all     # a section with its opt-in cases
    python -m bench.gpu_check --device cpu --quick --out /tmp/gc         # CI: every code path but CUDA's

It writes OUT/gpu_check.md, OUT/gpu_check.json and OUT/gpu_check_logs.tar.gz (train.py's logs and metrics, the
tracebacks), all three rewritten after every case, and nothing else into OUT: its scratch (run folders,
checkpoints) is --work_dir. A preflight first (about a second): versions, the GPU, the prepared data, free disk.
Every case runs in its own try/except and has a time limit; a case that no longer fits the budget is skipped.

Exit status: 0 every planned case passed and every target was measured and met; 1 a case failed or a target
was not met; 2 the command line was wrong; 3 nothing failed, but something planned was not measured (a case
skipped or stopped at its limit, a target with no number), listed at the top of gpu_check.md; 4 the preflight
found a problem, one line each with its fix, and nothing ran."""

import argparse
import os
import platform
import shutil
import sys
import tempfile
from contextlib import nullcontext

import torch

from bam.cli import Parser
from bam.outputs import check_apart
from bam.ranges import number
from bench.gpu_check import (attention, correctness, fsdp, flex_cost, flex_variants, graphs, long_context,
                             prior_tables, train_run, training)
from bench.gpu_check.common import DEMO_DATA, ROOT, Setup, flex_kernels_traced_by
from bench.gpu_check.preflight import preflight
from bench.gpu_check.report import (EXIT_PREFLIGHT, EXIT_STATUSES, EXIT_USAGE, REPORT_FILES, Report,
                                    counting_recompiles, now, one_line)

# In the order they run: the numbers a user needs first (training's tokens/s, MFU and memory; the ratio of the
# prior's attention cost), then what proves the path (tiny flex kernels, train.py, long contexts, the compiled
# model). The default ones are the acceptance run; the others run with --sections (all of them with --quick).
SECTIONS = {section.name: section for section in (
    training.SECTION, flex_cost.SECTION, flex_variants.SECTION, train_run.SECTION, long_context.SECTION,
    correctness.SECTION, graphs.SECTION, attention.SECTION, prior_tables.SECTION, fsdp.SECTION)}
ACCEPTANCE = tuple(name for name, section in SECTIONS.items() if section.default)
ACCEPTANCE_BUDGET_S = 460  # with ~20 s of start-up the default run ends within 8 minutes (tests hold its plan to it)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def parse_args(argv):
    ap = Parser(prog="python -m bench.gpu_check", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder: gpu_check.md, gpu_check.json, gpu_check_logs.tar.gz")
    ap.add_argument("--plan", action="store_true", help="print the plan (sections, cases, expected seconds) and exit")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu with --quick")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: every code path but CUDA's, for CI")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: the acceptance run, "
                         f"{','.join(ACCEPTANCE)}; all of them with --quick)")
    ap.add_argument("--all", action="store_true",
                    help="also the opt-in cases (the other encodings' training, the bf16 compiled model and the "
                         "correctness grid, 64K and 128K tokens, fp32 long rows, plain FSDP, the FSDP resumes, ...)")
    ap.add_argument("--budget_s", type=number(float, ">= 0"), default=None,
                    help="total time budget in seconds, split over the sections in proportion to their planned "
                         "seconds (default: the plan's sum, as --plan prints it; none with --quick)")
    ap.add_argument("--data_dir", default=DEMO_DATA,
                    help=f"train_run's token shards (default: {os.path.relpath(DEMO_DATA, ROOT)}, made by "
                         f"`python -m bench.gpu_check.prepare`)")
    ap.add_argument("--work_dir", default=None,
                    help="where the scratch for train.py's runs and checkpoints goes: a new folder gpu_check_* "
                         "inside it, kept (default: a new temporary folder, removed at the end); its logs reach OUT "
                         "in the archive")
    ap.add_argument("--compile_backend", default=None,
                    help="torch.compile backend for the model (default: inductor on CUDA, aot_eager on CPU)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.sections is None:
        args.sections = ",".join(SECTIONS if args.quick else ACCEPTANCE)
    args.section_list = [name for name in args.sections.split(",") if name]
    unknown = [name for name in args.section_list if name not in SECTIONS]
    if unknown or not args.section_list:
        fail(f"--sections: unknown section(s) {', '.join(unknown) or '(none given)'}; allowed: {', '.join(SECTIONS)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        fail(f"--device {args.device!r} is not a device; use cuda, cuda:N or cpu")
    if device.type not in ("cuda", "cpu"):
        fail(f"--device {args.device}: only cuda and cpu are supported")
    if device.type == "cpu" and not args.quick:
        fail("the full check needs a CUDA GPU (121M-model training and 256K-token prompts); on CPU use --quick")
    if args.plan:
        return args
    if args.out is None:
        fail("--out is required: the folder for gpu_check.md, gpu_check.json and gpu_check_logs.tar.gz")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        fail(f"--out {args.out} exists and is not a folder")
    if args.work_dir is not None:
        if os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
            fail(f"--work_dir {args.work_dir} exists and is not a folder")
        check_apart(args.work_dir, args.out, refused=lambda message: fail(message), source_name="--work_dir",
                    out_name="--out")
    args.data_dir = os.path.abspath(args.data_dir)
    return args


def build_plan(s, section_names):
    """[(Section, [Case])] in the order the sections run, the opt-in cases only with --all."""
    return [(section, [case for case in section.plan(s) if s.all or not case.opt_in])
            for name, section in SECTIONS.items() if name in section_names]


def print_plan(s, plan, args):
    total = sum(c.expected_s for _, cases in plan for c in cases)
    what = "the acceptance run" if set(args.section_list) == set(ACCEPTANCE) and not s.all and not s.quick else \
        "this selection"
    print(f"The plan of {what} on {'a CPU, --quick' if s.quick else 'one H100/H200'}: expected seconds per case "
          f"(compilation included); a case is stopped past twice its time (and 30 s more).")
    for section, cases in plan:
        print(f"\n{section.name}: {section.what} [{sum(c.expected_s for c in cases):.0f} s]")
        for case in cases:
            notes = [f"targets: {'; '.join(case.targets)}"] if case.targets else []
            notes += ["opt-in"] if case.opt_in else []
            print(f"  {case.expected_s:6.0f} s  {case.name}" + (f"  ({', '.join(notes)})" if notes else ""))
    budget = args.budget_s if args.budget_s is not None else total
    print(f"\ntotal: {total:.0f} s expected, budget {budget:.0f} s" +
          (f" (the acceptance run's is at most {ACCEPTANCE_BUDGET_S} s)" if what == "the acceptance run" else ""))
    if not s.all:
        extra = {section.name: [c for c in section.plan(s) if c.opt_in] for section, _ in plan}
        extra = {name: cases for name, cases in extra.items() if cases}
        if extra:
            print("--all adds the opt-in cases: " + "; ".join(
                f"{name} {len(cases)} ({sum(c.expected_s for c in cases):.0f} s)" for name, cases in extra.items()))


def main(argv=None):
    args = parse_args(argv)
    s = Setup(args)
    if args.plan:
        print_plan(s, build_plan(s, args.section_list), args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    own_work_dir = args.work_dir is None
    if not own_work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    # A folder of its own, inside --work_dir where one is given (and kept there): every run folder it starts
    # over and every checkpoint it removes is then one this call wrote, never a file of the user's
    s.work_dir = tempfile.mkdtemp(prefix="gpu_check_", dir=args.work_dir)
    threads = torch.get_num_threads()
    try:
        select_device(s)
        if not s.cuda:
            torch.set_num_threads(1)  # tiny shapes: a second thread only adds contention on a shared CI machine
        with counting_recompiles() as counting:
            return run(s, args, counting)
    finally:
        torch.set_num_threads(threads)
        if own_work_dir:
            shutil.rmtree(s.work_dir, ignore_errors=True)


def select_device(s):
    """--device cuda:N makes GPU N the current one; plain `cuda` keeps the current one (torch.cuda.set_device
    refuses a device without an index)."""
    if s.cuda and s.device.index is not None and torch.cuda.is_available():
        torch.cuda.set_device(s.device)


def run(s, args, counting):
    t0 = now()
    lines, problems = preflight(s, args.section_list, s.work_dir)
    print("preflight:\n" + "\n".join(f"  {line}" for line in lines) + f"\n  ({now() - t0:.1f} s)", flush=True)
    if not problems:
        s.probe()
    plan = build_plan(s, args.section_list)
    budget = args.budget_s if args.budget_s is not None else (None if s.quick else sum(
        c.expected_s for _, cases in plan for c in cases))
    env = {"device_name": s.device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "quick": s.quick, "all": s.all, "peak_tflops": s.peak_tflops,
           "compile_backend": s.compile_backend, "budget_s": budget, "argv": args.argv, "preflight": lines,
           "notes": notes(s, counting)}
    report = s.report = Report(args.out, s.work_dir, env, plan, budget, judged=s.cuda)
    if problems:
        report.refused = problems
        report.write()
        print(f"\nthe preflight found {len(problems)} problem(s); nothing ran:", file=sys.stderr)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_PREFLIGHT
    print(f"gpu_check on {s.device_name}, torch {torch.__version__}; writing {args.out}/{REPORT_FILES[0]}; "
          f"scratch in {s.work_dir}", flush=True)
    with flex_kernels_traced_by(s.compile_backend) if not s.cuda else nullcontext():
        for section, cases in plan:
            run_section(s, report, section, cases)
    report.write()
    status = report.exit_status()
    failed, missing = report.failed(), report.not_measured()
    print(f"\n{len(report.cases)} cases; exit {status}: {EXIT_STATUSES[status]}"
          + (f"; failed: {'; '.join(failed)}" if failed else "")
          + (f"; not measured: {'; '.join(missing)}" if missing else "")
          + f"; {now() - report.start:.0f} s; {args.out}/{REPORT_FILES[0]}")
    return status


def run_section(s, report, section, cases):
    report.begin_section(section.name)
    torch._dynamo.reset()  # each section compiles its own kernels; dynamo's recompile budget starts afresh
    try:
        with section.around(s) if section.around else nullcontext():
            for case in cases:
                report.run(case)
    except Exception as exc:  # the section's own set-up or tear-down failed: record it, keep the other sections
        report.keep_traceback("(section)")
        report.add("(section)", "fail", {"error": one_line(exc)})
    report.end_section()


def notes(s, counting):
    out = []
    if not s.cuda:
        out += ["CPU: FlexAttention has no backward pass here (torch 2.13) and inductor's C++ takes ~30 s a flex "
                "kernel, so the flex kernels are traced by aot_eager (flex's reference math) and compared forward "
                "only; sdpa's forward+backward stands in where a GPU runs flex's; the targets are the GPU's (n/a).",
                "CPU: no device-sync check (torch.cuda.set_sync_debug_mode is CUDA's); the graphs section shows the "
                "forward traced without a graph break, which a host read of a tensor would cause."]
    if not counting:
        out.append("no torch._dynamo.guards.recompiles_log in this torch: in-process recompiles read 0")
    return out


if __name__ == "__main__":
    sys.exit(main())
