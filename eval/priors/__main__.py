"""`python -m eval.priors RUN`: the command line of the priors evaluator (eval/priors/__init__.py), a package
because its measurements, its plots and its report section make more than one file of reading."""

from eval.priors import EVALUATOR

if __name__ == "__main__":
    EVALUATOR.cli()
