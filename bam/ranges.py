"""
What a number may be, said once where the option is declared and checked once where it is read.

A range is a short text that is both the rule and the words of the error: "> 0", ">= 1", ">= 0, <= 1",
"> 0, < 1". Every number must also be finite: inf and nan are never a setting.

    check("model.rope_theta", 0.0, "> 1")   # ValueError: model.rope_theta = 0.0: allowed: a number > 1
    ap.add_argument("--temperature", type=number(float, ">= 0"), default=0.8)

`number` is the argparse type of every numeric flag of every command (tests/test_ranges.py finds any
flag declared with a plain int or float and fails), so a flag's value is refused by argparse, in one line
naming the flag, the value and what is allowed, before the command has done anything. The config
sections declare theirs in RANGES tables (bam/config.py; ModelConfig in model.py, which has its own copy of
this check because model.py is copied alone into Hugging Face exports).
"""

import argparse
import math
import operator
import re

OPERATORS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_PART = re.compile(r"\s*(>=|>|<=|<)\s*(-?[0-9][0-9_.e+-]*)\s*")


def bounds(spec):
    """"> 0, <= 1" -> [(operator.gt, 0.0), (operator.le, 1.0)]; a ValueError for a spec that is not one."""
    out = []
    for part in spec.split(","):
        m = _PART.fullmatch(part)
        if not m:
            raise ValueError(f"not a range: {spec!r} (write e.g. '> 0' or '>= 0, <= 1')")
        out.append((OPERATORS[m[1]], float(m[2])))
    return out


def allowed(kind, spec):
    """The words for what a range allows: 'an integer >= 1', 'a number > 0, < 1'."""
    if kind is int:
        return f"an integer {spec}" if spec else "an integer"
    return f"a finite number {spec}" if spec else "a finite number"


def problem(value, spec, kind=float):
    """Why `value` is not allowed ("" when it is): not a number of the kind, not finite, or out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return "not " + ("an integer" if kind is int else "a number")
    if not math.isfinite(value):
        return "not finite"
    if spec and not all(op(value, limit) for op, limit in bounds(spec)):
        return "out of range"
    return ""


def check(name, value, spec, kind=float):
    """A ValueError `NAME = VALUE: allowed: ...` unless `value` is a finite `kind` within `spec`."""
    if problem(value, spec, kind):
        raise ValueError(f"{name} = {value!r}: allowed: {allowed(kind, spec)}")
    return value


class number:
    """The argparse type of a numeric flag: `number(int, ">= 1")`, `number(float, "> 0")`. It reads
    decimal text (underscores allowed; an int flag takes only whole numbers) and refuses inf, nan and
    values outside `spec` with argparse's own one-line error, naming the flag."""

    def __init__(self, kind, spec=""):
        if kind not in (int, float):
            raise TypeError("number() is for int or float flags")
        bounds(spec) if spec else None  # a wrong spec fails when the parser is built, not when it is used
        self.kind, self.spec = kind, spec
        self.__name__ = kind.__name__  # argparse names the type in some of its messages

    def __call__(self, text):
        try:
            value = self.kind(text.replace("_", "")) if isinstance(text, str) else text
        except ValueError:
            value = text
        if problem(value, self.spec, self.kind):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {allowed(self.kind, self.spec)}")
        return value

    def __repr__(self):
        return f"number({self.kind.__name__}, {self.spec!r})"
