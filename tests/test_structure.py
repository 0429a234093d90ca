"""The repository's shape, read from its source with `ast` (nothing is imported): the modules form floors, each
importing only modules on its own floor or below (docs/INTERFACES.md, "Layout"), with no import cycle; a
module imports our own modules at its top, never inside a function (that only hides a cycle), except for the
few reasons in ALLOWED_LATE_IMPORTS; the root holds the commands and the model, the library lives in bam/;
nothing edits sys.path at module level; the evaluators stay small, and no two modules of one eval/ folder have
names that a reader could take for each other."""

import ast
import os
import re

import pytest

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
     "modeling_bam"],  # the commands, the evaluators and the benchmarks
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


@pytest.mark.parametrize("folder", ["bench", "tests", "eval", "bam", "."])
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
