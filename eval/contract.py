"""What an evaluator declares, and what the command line and eval.report then do with it.

An evaluator is a module eval/NAME.py that ends with

    EVALUATOR = Evaluator(name="NAME", title=..., description=..., add_arguments=..., run=...,
                          table=..., plot=..., section=...)
    main = EVALUATOR.main

    if __name__ == "__main__":
        EVALUATOR.cli()

and is listed in eval.EVALUATORS; one too large for a file is a package, eval/NAME/, whose __init__.py
declares EVALUATOR and whose __main__.py calls EVALUATOR.cli() (eval.priors). `python -m eval.NAME` then
reads its own options and the shared ones it asks for (eval.options, eval.sweep) into an EvalOptions and
calls `run`. eval.report finds its results files (schema NAME), puts `section` under `title`, links each
run's plots (`run_plots`) and draws `summary_plot` beside the report.
"""

from dataclasses import dataclass
from typing import Callable

from bam.cli import Parser, run_cli
from eval.options import parse_arguments


@dataclass(frozen=True)
class Evaluator:
    name: str  # the results' "schema", the default results file name, and `python -m eval.NAME`
    title: str  # the report's section heading
    description: str  # the module's docstring: its first paragraph heads --help
    add_arguments: Callable  # (parser): the command line; shared groups come from eval.options / eval.sweep
    run: Callable  # (args, options: EvalOptions): what the command does with the parsed command line
    table: Callable  # (results) -> str: printed on stdout
    plot: Callable | None  # (results, path): the PNG beside the results file; None if it draws its own (priors)
    section: Callable  # (runs: [eval.runs.Run], report_options: dict) -> [markdown lines]
    summary_plot: Callable | None = None  # (runs, path) -> bool (drawn or not): one figure over every run
    run_plots: tuple = ()  # ((label, suffix), ...): each run's plots the report links; () = ((name, ""),)
    report_arguments: Callable | None = None  # (parser): options of eval.report that its section reads
    interrupted: str | None = None  # what Ctrl-C prints (None: a plain KeyboardInterrupt)

    def plots(self):
        """(label, file suffix) of every per-run plot: <results file stem><suffix>.png."""
        return self.run_plots or ((self.name, ""),)

    def main(self, argv=None):
        parser = Parser(prog=f"eval.{self.name}", description=self.description.strip().split("\n\n")[0])
        self.add_arguments(parser)
        args, options = parse_arguments(parser, argv)
        self.run(args, options)
        return 0

    def cli(self):
        run_cli(self.main, interrupted=self.interrupted)
