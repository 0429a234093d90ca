"""Every command in README.md runs as written: each bash block's commands are read as a user would copy them,
and each is held to what it calls. A Python command's script or module must exist and accept every option the
command gives it (its own --help, run for real, lists them); a config file, script or requirements file it
names must exist (a glob must match); `RUNS` names configs that exist, also where scripts/quickstart.sh holds
them; the test command is exactly what .ci/run runs and ends in the suite, and the fast lane's `-m "not slow"`
leaves out tests of a registered marker. The
commands that train or evaluate for minutes are run end to end by their own tests (tests/test_repro.py runs
configs/repro/run.sh; the evaluators' tests run each evaluator), not again here."""

import configparser
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PLACEHOLDER = re.compile(r"^(RUN\d*|OUT|NAME)$")  # what a user replaces: a run directory of theirs


def readme_commands(text):
    """[(line number, argv)] of every command in the README's ```bash blocks: continuation lines joined,
    comments dropped, `a && b` and `a; b` split."""
    commands, block, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            block = [] if block is None and line.strip() == "```bash" else None
            continue
        if block is None:
            continue
        if not block:
            start = number
        block.append(line)
        if line.rstrip().endswith("\\"):
            continue
        joined = " ".join(part.rstrip().removesuffix("\\") for part in block)
        block = []
        words = shlex.split(joined, comments=True)
        current = []
        for word in words + ["&&"]:
            if word in ("&&", ";"):
                if current:
                    commands.append((start, current))
                current = []
            else:
                current.append(word)
    return commands


COMMANDS = readme_commands(open(README, encoding="utf-8").read())


def split_env(argv):
    env = {}
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        key, value = argv[0].split("=", 1)
        env[key], argv = value, argv[1:]
    return env, argv


def python_target(argv):
    """(interpreter arguments that name the program, its arguments) of a python or torchrun command."""
    if argv[0] == "torchrun":
        argv = [a for a in argv[1:] if not a.startswith("--")]  # torchrun's own options go before the script
        return [argv[0]], argv[1:]
    assert argv[0] == "python", argv
    if argv[1] == "-m":
        return argv[1:3], argv[3:]
    return argv[1:2], argv[2:]


def test_the_readme_has_commands_and_each_is_checked_here():
    kinds = {split_env(argv)[1][0] for _, argv in COMMANDS}
    assert {"python", "bash", "torchrun"} <= kinds, kinds
    assert kinds <= {"python", "bash", "pip", "torchrun"}, f"a kind of command this test does not check: {kinds}"


TEST_COMMAND = ["bash", "scripts/test.sh"]  # scripts/setup.sh, then python -m pytest
FAST_LANE = ["python", "-m", "pytest", "-m", "not slow"]


def script_lines(path):
    return [line.strip() for line in open(os.path.join(ROOT, path)) if line.strip() and not line.startswith("#")]


def test_the_test_command_is_what_ci_runs_and_the_fast_lane_leaves_out_the_slow_tests():
    assert TEST_COMMAND in [argv for _, argv in COMMANDS]
    assert {tuple(argv) for _, argv in COMMANDS if argv[:3] == ["python", "-m", "pytest"]} == {tuple(FAST_LANE)}
    assert script_lines(".ci/run")[-1] == " ".join(TEST_COMMAND)
    assert script_lines("scripts/test.sh")[-2:] == ["bash scripts/setup.sh", 'exec python -m pytest "$@"']
    # the marker it leaves out is registered (an unknown one would select everything) and marks tests
    markers = configparser.ConfigParser()
    markers.read(os.path.join(ROOT, "pytest.ini"))
    assert any(line.startswith("slow:") for line in markers["pytest"]["markers"].splitlines())
    marked = [name for name in os.listdir(os.path.join(ROOT, "tests")) if name.endswith(".py")
              and "mark.slow" in open(os.path.join(ROOT, "tests", name), encoding="utf-8").read()]
    assert marked


@pytest.mark.slow
def test_the_fast_lane_runs_as_written_and_selects_tests_and_leaves_some_out():
    # -n 0: collected once, in this pytest; under pytest.ini's -n auto each xdist worker would collect the whole
    # suite again (importing torch, transformers and datasets), ~8 s of CPU for the same selection
    collected = subprocess.run([sys.executable, *FAST_LANE[1:], "--collect-only", "-n", "0", "-p", "no:cacheprovider"],
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    summary = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", collected.stdout)
    assert summary and int(summary[1]) > 0 and int(summary[3]) > 0, collected.stdout[-500:]


def script_runs(argv):
    """The runs a script of the README's (scripts/quickstart.sh) gives configs/repro/run.sh by default."""
    if argv[0] != "bash" or not argv[1].startswith("scripts/"):
        return []
    found = re.search(r'RUNS=\$\{RUNS:-"([^"]*)"\}', open(os.path.join(ROOT, argv[1]), encoding="utf-8").read())
    return found[1].split() if found else []


def test_every_file_a_command_names_exists():
    missing = []
    for number, argv in COMMANDS:
        env, argv = split_env(argv)
        for word in argv[1:]:
            if word.startswith("-") or "/" not in word and not word.endswith((".txt", ".toml", ".sh", ".py")):
                continue
            if word.split("/")[0] in ("runs", "data", "hf", "out") or PLACEHOLDER.match(word):
                continue  # what the commands write, or the user's own run
            if not glob.glob(os.path.join(ROOT, word)):  # a glob names at least one file, as the shell needs
                missing.append(f"README.md:{number}: {word}")
        for name in env.get("RUNS", "").split() + script_runs(argv):
            if not os.path.isfile(os.path.join(ROOT, "configs", "repro", name.split("@")[0] + ".toml")):
                missing.append(f"README.md:{number}: RUNS names {name}, no configs/repro/{name}.toml")
    assert not missing, "\n".join(missing)


PYTHON_COMMANDS = [(n, argv) for n, argv in COMMANDS if split_env(argv)[1][0] in ("python", "torchrun")
                   and split_env(argv)[1][:3] != ["python", "-m", "pytest"]]


PROGRAMS = sorted({tuple(python_target(split_env(a)[1])[0]) for _, a in PYTHON_COMMANDS})

# Each program's --help, run as `python [-m] PROGRAM --help` runs it (runpy, as __main__, with that argv), all in
# one interpreter started here: one import of torch, not one per program.
HELP = """
import contextlib, io, json, runpy, sys, traceback
found = {}
for program in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [program[-1], "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if program[0] == "-m":
                runpy.run_module(program[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(program[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        except Exception:  # a program that cannot start: its test fails with the traceback
            code = 1
            traceback.print_exc(file=err)
    found[" ".join(program)] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def help_texts():
    """{program: (exit status, stdout, stderr)} of every README program's --help."""
    done = subprocess.run([sys.executable, "-c", HELP, json.dumps(PROGRAMS)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS, ids=" ".join)
def test_every_option_a_python_command_gives_is_one_its_program_accepts(program, help_texts):
    code, help_text, errors = help_texts[" ".join(program)]
    assert code == 0 and help_text, errors[-2000:]
    unknown = []
    for number, argv in PYTHON_COMMANDS:
        target, args = python_target(split_env(argv)[1])
        if tuple(target) != program:
            continue
        for word in args:
            option = word.split("=", 1)[0]
            # train.py's --section.key=value overrides are the config's keys, which its --help does not list
            # one by one: tests/test_config.py holds those to the schema
            if option.startswith("--") and "." not in option and option not in help_text:
                unknown.append(f"README.md:{number}: {' '.join(program)} has no option {option}")
    assert not unknown, "\n".join(unknown)


def test_the_reader_splits_and_joins_as_a_shell_does():
    text = "```bash\nA=1 bash x.sh --n 2 \\\n   --m 3   # a comment\npip install -r a.txt && python -m b c\n```\n" \
           "```python\nnot = 'a command'\n```\n"
    assert readme_commands(text) == [(2, ["A=1", "bash", "x.sh", "--n", "2", "--m", "3"]),
                                     (4, ["pip", "install", "-r", "a.txt"]), (4, ["python", "-m", "b", "c"])]
