"""The repository's shape, read from its source with `ast` (nothing is imported): the modules form floors, each
importing only modules on its own floor or below (docs/INTERFACES.md, "Layout"), with no import cycle; a
module imports our own modules at its top, never inside a function (that only hides a cycle), except for the
few reasons in ALLOWED_LATE_IMPORTS; the root holds the commands and the model, the library lives in bam/;
nothing edits sys.path at module level; the evaluators stay small, and no two modules of one eval/ folder have
names that a reader could take for each other; a shared helper of tests/ names the test files that use it. The
fast lane starts no process and compiles nothing: read from the test files, and seen from tests/conftest.py's
guard (the one test here that imports what it checks)."""

import ast
import os
import re
import subprocess

import pytest

import model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top. A module may import modules of its own floor and the floors below it, never one above.
FLOORS = [
    ["model"],  # the whole architecture; imports nothing of ours (an export copies it alone)
    ["bam.cli", "bam.ranges"],  # one-line errors and the CLI; the notation of ranges
    ["bam.outputs"],  # every atomic write and swap of a file or folder, and the locks
    ["bam.tokenizer"],  # GPT-2 (tiktoken) and any Hugging Face tokenizer
    ["bam.data"],  # shard formats and the loader
    ["bam.config"],  # the TOML schema
    ["bam.checkpoint"],  # run directories, checkpoints, the model's load and save
    ["bam.recovery", "bam.parallel", "bam.sizing", "bam.retrieval"],  # what training needs beside them
    ["eval", "eval.*", "bench", "bench.*", "train", "prepare_fineweb", "sample", "export_hf", "import_hf",
     "modeling_bam", "bam.fetch"],  # the commands (the set-up step among them), the evaluators and the benchmarks
]

# Function-level imports of our own modules that stay, each with its reason: (importing module pattern,
# imported module) -> why. Everything else is imported at the top of its module.
ALLOWED_LATE_IMPORTS = {
    ("eval.*", "eval.plotting"): "eval.plotting is matplotlib: an evaluator loads it only when it draws",
}

ROOT_COMMANDS = 8  # at most this many .py files at the root: the commands and the model beside its wrapper
EVALUATOR_LINES = 400  # a module of eval/ (an evaluator's package included) reads in one sitting (issue 19)


def source_files():
    """{module name: path} of every Python file of the repository outside tests/ (which imports what it tests)."""
    files = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and d not in ("tests", "runs", "data", "docs")]
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                files[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return files


MODULES = source_files()


def ours(name):
    """The module of ours that an import of `name` loads, or None for a library's."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module):
    """[(imported module of ours, line, at the module's top level)] of one module."""
    path = MODULES[module]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: modeling_bam's `from .model import ...` inside an export folder
                    base = ".".join(module.split(".")[:-child.level] + ([base] if base else []))
                names = [f"{base}.{alias.name}" if ours(f"{base}.{alias.name}") == f"{base}.{alias.name}" else base
                         for alias in child.names]
            else:
                visit(child, inner)
                continue
            for name in names:
                target = ours(name)
                if target is not None and target != module:
                    found.append((target, child.lineno, not in_function))
    visit(tree, False)
    return found


def floor_of(module):
    for level, members in enumerate(FLOORS):
        if any(module == m or (m.endswith(".*") and module.startswith(m[:-1])) for m in members):
            return level
    raise AssertionError(f"{module} has no floor in tests/test_structure.py FLOORS: add it where it belongs")


def matches(pattern, module):
    return module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1]))


def test_every_module_has_a_floor_and_imports_none_above_it():
    wrong = []
    for module in MODULES:
        mine = floor_of(module)
        for target, line, top in imports(module):
            if floor_of(target) > mine:
                wrong.append(f"{MODULES[module]}:{line} imports {target}, a floor above {module}")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle():
    graph = {m: sorted({t for t, _, _ in imports(m)}) for m in MODULES}
    state, cycles = {}, []

    def walk(node, stack):
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = "done"

    for module in graph:
        if module not in state:
            walk(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_our_modules_are_imported_at_the_top_but_for_the_listed_reasons():
    late = []
    for module in MODULES:
        for target, line, top in imports(module):
            allowed = any(matches(who, module) and target == what for who, what in ALLOWED_LATE_IMPORTS)
            if not top and not allowed:
                late.append(f"{MODULES[module]}:{line} imports {target} inside a function")
    assert not late, "\n".join(late)


def test_the_allow_list_has_no_entry_left_unused():
    used = {(who, what) for module in MODULES for target, _, top in imports(module) if not top
            for who, what in ALLOWED_LATE_IMPORTS if matches(who, module) and target == what}
    assert set(ALLOWED_LATE_IMPORTS) == used


def test_model_py_imports_nothing_of_ours():
    assert imports("model") == []


def test_the_root_holds_the_commands_and_the_library_is_one_package():
    root = sorted(n for n in os.listdir(ROOT) if n.endswith(".py"))
    assert len(root) <= ROOT_COMMANDS, root
    library = sorted(m for m in MODULES if m.startswith("bam."))
    assert {"bam.outputs", "bam.checkpoint", "bam.tokenizer", "bam.data", "bam.config"} <= set(library)


def module_level_nodes(tree):
    """Every node that runs when the module is imported: not inside a function (a string is not code)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


@pytest.mark.parametrize("folder", ["bench", "tests", "tests/model", "eval", "bam", "."])
def test_nothing_edits_sys_path_at_module_level(folder):
    edits = []
    for name in sorted(os.listdir(os.path.join(ROOT, folder))):
        if not name.endswith(".py"):
            continue
        path = os.path.join(ROOT, folder, name)
        for node in module_level_nodes(ast.parse(open(path, encoding="utf-8").read())):
            text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Assign)) else ""
            if re.fullmatch(r"sys\.path\.(insert|append|extend)\(.*\)|sys\.path = .*", text, re.S):
                edits.append(f"{path}:{node.lineno}")
    assert not edits, edits


def importers(module):
    """The test files (paths from tests/, subfolders' too) that import `module`, a helper of tests/."""
    found = set()
    for root, dirs, names in os.walk(os.path.join(ROOT, "tests")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        for name in names:
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(root, name)
                tree = ast.parse(open(path, encoding="utf-8").read())
                if any(isinstance(node, ast.ImportFrom) and node.module == module or isinstance(node, ast.Import)
                       and any(alias.name == module for alias in node.names) for node in ast.walk(tree)):
                    found.add(os.path.relpath(path, os.path.join(ROOT, "tests")))
    return found


@pytest.mark.parametrize("helper", ["tiny_models", "small_runs"])
def test_a_shared_test_helpers_header_names_every_file_that_uses_it(helper):
    """So that a reader finds its examples (issue 56: tiny_models' header named three of its six users): every
    test_*.py file its docstring names imports it, and every one that imports it is named there, or lies in
    tests/model/ when the docstring says every file there does."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "tests", f"{helper}.py"), encoding="utf-8").read()))
    users = importers(helper)
    in_model = {user for user in users if user.startswith("model" + os.sep)}
    if "every file of tests/model/" in doc:
        model_tests = {os.path.join("model", name) for name in os.listdir(os.path.join(ROOT, "tests", "model"))
                       if name.startswith("test_") and name.endswith(".py")}
        assert in_model == model_tests, sorted(model_tests - in_model)
        users -= in_model
    named = set(re.findall(r"(?<![\w/])test_\w+\.py", doc))  # not a cited path (this checker)
    assert named == users, f"named, not importing it: {sorted(named - users)}; importing it, not named: " \
        f"{sorted(users - named)}"


def test_the_longest_files_that_conftest_hands_out_first_are_test_files():
    """tests/conftest.py's LONGEST_FILES orders the run; a renamed file would drop out of it silently. (Read from
    its source: importing conftest.py a second time would run its set-up again.)"""
    tree = ast.parse(open(os.path.join(ROOT, "tests", "conftest.py"), encoding="utf-8").read())
    LONGEST_FILES = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                         and [ast.unparse(target) for target in node.targets] == ["LONGEST_FILES"])
    missing = [name for name in LONGEST_FILES if not os.path.isfile(os.path.join(ROOT, "tests", name))]
    assert not missing and len(set(LONGEST_FILES)) == len(LONGEST_FILES), missing


def test_one_module_renames_files_into_place():
    """os.replace / os.rename (and the folder exchange) happen in bam/outputs.py only, the one writer."""
    renamers = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("replace", "rename", "renames") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "os":
                renamers.append(module)
    assert set(renamers) == {"bam.outputs"}, sorted(set(renamers))


def test_every_evaluator_is_under_its_line_budget():
    long = {m: n for m, p in MODULES.items() if m.startswith("eval.")
            for n in [sum(1 for _ in open(p, encoding="utf-8"))] if n > EVALUATOR_LINES}
    assert not long, long


def name_clashes(names):
    """Pairs of module names of one folder where one, less a plural s, begins the other (report and reporting,
    priors and prior_plots): two names that say the same thing."""
    stems = {name: name.removesuffix("s") for name in names}
    return sorted((a, b) for a in names for b in names if a != b and b.startswith(stems[a]))


def test_no_two_modules_of_an_eval_folder_share_a_name():
    folders = {}
    for module in MODULES:
        if module.startswith("eval.") and not module.endswith(".__main__"):
            folder, _, name = module.rpartition(".")
            folders.setdefault(folder, []).append(name)
    clashes = {folder: name_clashes(names) for folder, names in folders.items() if name_clashes(names)}
    assert not clashes, clashes
    assert name_clashes(["report", "reporting", "priors", "prior_plots", "runs"]) == [
        ("priors", "prior_plots"), ("report", "reporting")]


def test_the_checker_sees_a_late_import_and_a_floor_above(tmp_path, monkeypatch):
    """The reader itself: a planted late import and an import from a floor above are found."""
    (tmp_path / "bam").mkdir()
    (tmp_path / "bam" / "tokenizer.py").write_text("def f():\n    from bam import data\n")
    (tmp_path / "bam" / "data.py").write_text("import bam.tokenizer\n")
    monkeypatch.setitem(MODULES, "bam.tokenizer", str(tmp_path / "bam" / "tokenizer.py"))
    monkeypatch.setitem(MODULES, "bam.data", str(tmp_path / "bam" / "data.py"))
    assert imports("bam.tokenizer") == [("bam.data", 2, False)]
    assert imports("bam.data") == [("bam.tokenizer", 1, True)]
    assert floor_of("bam.data") > floor_of("bam.tokenizer")


# The fast lane (`python -m pytest -m "not slow"`, pytest.ini's `slow` marker): a test that starts a process or
# a process group, or compiles, is marked slow. Read from the test files: what a test's body, the module-level
# helpers and fixtures it uses (and theirs, and the shared helpers of tests/) touch. tests/conftest.py also
# fails such a test when it runs unmarked (the flex path and compiles made inside the library included).
# The guard's own test starts nothing: the guard refuses it.
FAST_LANE_EXCEPTIONS = {
    ("test_structure.py", "test_the_fast_lane_refuses_a_process_and_the_flex_path_to_an_unmarked_test")}
SLOW_WORK = {"subprocess": "a subprocess", "init_process_group": "a process group", "_dynamo": "dynamo",
             "compile": "torch.compile"}


def slow_work_in(node):
    """The slow work `node`'s own code names: subprocess.*, init_process_group, torch._dynamo, a call of
    .compile() (re.compile's excepted)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in ("subprocess", "init_process_group"):
            found.add(SLOW_WORK[sub.id])
        elif isinstance(sub, ast.Attribute) and sub.attr in ("init_process_group", "_dynamo"):
            found.add(SLOW_WORK[sub.attr])
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "compile" \
                and not (isinstance(sub.func.value, ast.Name) and sub.func.value.id == "re"):
            found.add(SLOW_WORK["compile"])
    return found


def names_used(node):
    """The names a function reads, and the fixtures it asks for by its arguments."""
    used = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name)}
    return used | {arg.arg for arg in node.args.args} if isinstance(node, ast.FunctionDef) else used


def marked_slow(decorators):
    """A `slow` mark anywhere in the decorators, a parametrize's pytest.param(..., marks=...) included: a test
    with some parameters marked counts as marked (conftest's guard still fails an unmarked parameter)."""
    return any(isinstance(sub, ast.Attribute) and sub.attr == "slow" for d in decorators for sub in ast.walk(d))


def functions_of(tree):
    """{name: FunctionDef} of a module's top level and of its classes' methods."""
    found = {}
    for node in tree.body:
        for fn in ([node] if isinstance(node, ast.FunctionDef) else
                   [n for n in node.body if isinstance(n, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else []):
            found.setdefault(fn.name, fn)
    return found


def slow_functions(trees):
    """{name: what slow work} of every function in `trees` that does slow work itself or through another one
    of them (by name: the test files' helpers, fixtures and the shared modules of tests/ read as one scope)."""
    functions = {name: fn for tree in trees for name, fn in functions_of(tree).items()}
    work = {name: slow_work_in(fn) for name, fn in functions.items()}
    calls = {name: names_used(fn) & functions.keys() - {name} for name, fn in functions.items()}
    changed = True
    while changed:
        changed = False
        for name in functions:
            reached = set().union(*(work[other] for other in calls[name])) - work[name]
            if reached:
                work[name] |= reached
                changed = True
    return {name: sorted(found) for name, found in work.items() if found}


def unmarked_slow_tests(folder):
    """{file: {test: slow work}} of the tests under `folder` (its subfolders' too: tests/model/) that do slow work
    without the `slow` marker; a file is named by its path from `folder`."""
    trees = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    trees[os.path.relpath(path, folder)] = ast.parse(f.read(), name)
    shared = [tree for name, tree in trees.items() if not os.path.basename(name).startswith("test_")]
    found = {}
    for name, tree in trees.items():
        if not os.path.basename(name).startswith("test_") or any(
                isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                and marked_slow([node.value]) for node in tree.body):
            continue
        slow = slow_functions([tree, *shared])
        classes = {fn: cls for cls in tree.body if isinstance(cls, ast.ClassDef) for fn in functions_of(cls)}
        tests = {test: slow[test] for test, fn in functions_of(tree).items() if test.startswith("test_")
                 and test in slow and not marked_slow(fn.decorator_list) and (name, test) not in FAST_LANE_EXCEPTIONS
                 and not (test in classes and marked_slow(classes[test].decorator_list))}
        if tests:
            found[name] = tests
    return found


def test_the_fast_lane_starts_no_process_and_compiles_nothing():
    assert unmarked_slow_tests(os.path.join(ROOT, "tests")) == {}


def test_the_fast_lane_scan_sees_a_process_a_compile_and_a_mark(tmp_path):
    """The reader itself: a planted test that starts a process through a helper, one that compiles through a
    fixture, are found, in a subfolder too; marked (one by its decorator, a file by pytestmark) they are not."""
    (tmp_path / "helpers.py").write_text("import subprocess\n\ndef launch():\n    subprocess.run(['true'])\n")
    body = ("import pytest, re, torch\nfrom helpers import launch\n\n{mark}def test_a():\n    launch()\n\n"
            "@pytest.fixture\ndef compiled():\n    return torch.compile(lambda x: x)\n\n"
            "def test_b(compiled):\n    pass\n\ndef test_c():\n    re.compile('x')\n")
    (tmp_path / "test_planted.py").write_text(body.format(mark=""))
    assert unmarked_slow_tests(tmp_path) == {"test_planted.py": {"test_a": ["a subprocess"],
                                                                  "test_b": ["torch.compile"]}}
    (tmp_path / "test_planted.py").write_text(body.format(mark="@pytest.mark.slow\n"))
    assert unmarked_slow_tests(tmp_path) == {"test_planted.py": {"test_b": ["torch.compile"]}}
    (tmp_path / "test_planted.py").write_text("import pytest\npytestmark = pytest.mark.slow\n" + body.format(mark=""))
    assert unmarked_slow_tests(tmp_path) == {}
    (tmp_path / "model").mkdir()  # a test in a subfolder (tests/model/), through the shared helper above
    (tmp_path / "model" / "test_deep.py").write_text(body.format(mark="@pytest.mark.slow\n"))
    assert unmarked_slow_tests(tmp_path) == {os.path.join("model", "test_deep.py"): {"test_b": ["torch.compile"]}}


def test_the_fast_lane_refuses_a_process_and_the_flex_path_to_an_unmarked_test():
    """tests/conftest.py's guard, seen from an unmarked test: starting a process and running the flex path
    (whose kernels are compiled) fail with the advice to mark the test; neither is started."""
    with pytest.raises(Exception, match="starts a subprocess: mark it @pytest.mark.slow"):
        subprocess.run(["true"])
    with pytest.raises(Exception, match="runs the flex path.*: mark it @pytest.mark.slow"):
        model.ATTENTION["flex"]()


# model.py's shape (issue 56): a reader follows a name to its definition within a few screens, Transformer
# reads like nanoGPT's GPT, and FlexAttention is one region at the bottom that a CPU reader can stop before.
REFERENCE_SPAN = 800
# The references that cross more lines, each with its reason: Transformer's two doors into the parts below it,
# which come after the encodings because an encoding is read before what the attention paths do with it.
FAR_REFERENCES = {
    ("Transformer", "attention_contexts"): "the forward's one call into the attention part",
    ("Transformer", "build_flex_kernels"): "made with the model: a compiled forward may not make a kernel",
}
TRANSFORMER_LINES = 220
FLEX_BANNER = "# FlexAttention:"


def top_level_references(path):
    """{(top-level name, name it references): (lines apart, line)} for model.py's names, the header's
    constants (what is assigned before the first class or function) left out."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    first = min(n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    defined, header = {}, set()
    for node in tree.body:
        targets = [node] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            getattr(node, "targets", [getattr(node, "target", None)])
        for target in targets:
            name = getattr(target, "name", None) or getattr(target, "id", None)
            if name:
                defined.setdefault(name, node.lineno)
                if node.lineno < first:
                    header.add(name)
    spans = {}
    for node in tree.body:
        owner = getattr(node, "name", None) or "<module>"
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in defined and sub.id not in header and sub.id != owner:
                span = abs(sub.lineno - defined[sub.id])
                spans[owner, sub.id] = max(spans.get((owner, sub.id), (0, 0)), (span, sub.lineno))
    return spans, defined, tree


MODEL_PY = os.path.join(ROOT, "model.py")


def test_no_reference_inside_model_py_crosses_more_than_a_few_screens():
    spans, _, _ = top_level_references(MODEL_PY)
    far = {pair: span for pair, (span, _) in spans.items() if span > REFERENCE_SPAN}
    unlisted = {pair: span for pair, span in far.items() if pair not in FAR_REFERENCES}
    assert not unlisted, (f"references over {REFERENCE_SPAN} lines (move the definition nearer, or list it with "
                          f"its reason in FAR_REFERENCES): {unlisted}")
    assert set(FAR_REFERENCES) <= set(far), f"listed but no longer far: {set(FAR_REFERENCES) - set(far)}"


def test_transformer_reads_like_nanogpts_gpt_and_flex_is_one_region_at_the_bottom():
    _, defined, tree = top_level_references(MODEL_PY)
    transformer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Transformer")
    assert transformer.end_lineno - transformer.lineno + 1 <= TRANSFORMER_LINES
    lines = open(MODEL_PY, encoding="utf-8").read().splitlines()
    banner = next(i for i, line in enumerate(lines, 1) if line.startswith(FLEX_BANNER))
    # every name of the flex runtime lies below the banner, and the banner is the file's last part
    flex_names = [name for name in defined if re.search(r"flex|block_mask|sink_(form|score_mod)|with_sink", name,
                                                        re.IGNORECASE) and name not in ("FLEX_PRIORS",)]
    above = [name for name in flex_names if defined[name] < banner]
    assert not above, f"FlexAttention's names above its region ({FLEX_BANNER!r}, line {banner}): {above}"
    assert not any(line.startswith("# ----") for line in lines[banner:]), "a part after FlexAttention's region"
    # the region is FlexAttention's alone: nothing above it that is not flex reaches into it but its doors
    spans, _, _ = top_level_references(MODEL_PY)
    into = {(owner, name) for (owner, name) in spans if name in flex_names and defined[name] > banner
            and owner in defined and defined[owner] < banner and owner not in flex_names}
    assert into <= {("Transformer", "build_flex_kernels"), ("attention_contexts", "flex_prior_tables"),
                    ("attention_context", "make_block_mask")}, into
