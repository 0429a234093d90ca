"""cli.py: a user error is one `error: ...` line and a non-zero exit; only the speaking rank prints; and
train.py stays a story of short named steps."""

import ast
import os

import pytest

from bam import cli
from bam.cli import Parser, UserError, error_line, fail, run_cli, user_errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fail_and_user_errors_print_one_line(capsys, monkeypatch):
    with pytest.raises(SystemExit) as info:
        with user_errors():
            raise UserError("data.data_dir = '/x' holds no shards")
    assert info.value.code == 1
    assert capsys.readouterr().err == "error: data.data_dir = '/x' holds no shards\n"

    monkeypatch.setattr(cli, "SILENT_RANK_WAIT_S", 0.01)  # a silent rank waits for rank 0 to speak first
    with pytest.raises(SystemExit) as info:
        fail("rank 1 knows too", speak=False)  # torchrun: every rank exits, one speaks
    assert info.value.code == 1 and capsys.readouterr().err == ""

    with pytest.raises(ZeroDivisionError):  # a bug is not a user error: its traceback stays
        with user_errors():
            1 / 0


def test_run_cli_exit_status(capsys):
    def main(argv):
        if argv == ["bad"]:
            raise UserError("bad argument")
        return int(argv[0])
    for argv, code in ((["0"], 0), (["3"], 3), (["bad"], 1)):
        with pytest.raises(SystemExit) as info:
            run_cli(main, argv)
        assert info.value.code == code
    assert capsys.readouterr().err == "error: bad argument\n"


def test_parser_errors_are_one_line_with_status_2(capsys):
    parser = Parser(prog="tool.py")
    parser.add_argument("--n", type=int, required=True)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--n", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tool.py: argument --n: invalid int value: 'many'") and err.count("\n") == 1


def test_every_function_in_train_py_is_short():
    """train.py reads as named steps (issue 10); none of them grows past about a screen."""
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    lengths = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert len(lengths) > 15 and "main" in lengths
    long = {name: n for name, n in lengths.items() if n > 60}
    assert not long, long


def test_error_line_keeps_the_reason_that_a_library_puts_after_its_first_line():
    validation = ValueError("Class validation error for validator 'validate_layer_type':\n"
                            "    ValueError: `num_hidden_layers` (4) must be equal to the number of `layer_types` (2)")
    assert error_line(validation) == ("Class validation error for validator 'validate_layer_type': ValueError: "
                                      "`num_hidden_layers` (4) must be equal to the number of `layer_types` (2)")
    assert error_line(KeyError("Missing required keys in `rope_parameters`: {'factor'}")) == \
        "Missing required keys in `rope_parameters`: {'factor'}"  # str() of a KeyError would quote it
    assert error_line(RuntimeError("")) == "RuntimeError"
    state_dict = RuntimeError("Error(s) in loading state_dict for Transformer:\n\tMissing key(s) in state_dict: "
                              + ", ".join(f'"blocks.{i}.attn.wq.weight"' for i in range(40)))
    cut = error_line(state_dict, limit=120)
    assert len(cut) == 120 and cut.startswith("Error(s) in loading state_dict for Transformer: Missing key(s)") \
        and cut.endswith("...")
