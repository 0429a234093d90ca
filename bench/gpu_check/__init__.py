"""The GPU acceptance run: one command that proves the GPU path before a long run and measures what a user asks
first (docs/benchmarks.md, "GPU check"). `python -m bench.gpu_check --help` and --plan say what it runs.

    cli.py            the command (__main__.py runs it): arguments, the plan, the preflight, the sections in
                      order, the exit status
    report.py         the record: cases and sections, budgets and time limits, gpu_check.md/.json, the logs'
                      archive, what the exit status means
    preflight.py      the second before anything compiles: versions, the GPU, the prepared data, free disk
    prepare.py        `python -m bench.gpu_check.prepare`: the data the run brings along (data/gpu_check)
    common.py         the run's Setup, batches, tolerances and the comparison with the eager reference
    then one module per section, in the order they run: training, flex_cost, flex_variants, train_run (and the
    rank torchrun starts), long_context, correctness (the acceptance run); graphs, attention, prior_tables,
    fsdp (on request, and in --quick)

Nothing is imported here: the rank that torchrun starts (train_run) imports train.py and little else.
"""
