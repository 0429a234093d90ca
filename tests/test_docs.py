"""Every file the repository cites exists in the repository: paths in the comments and docstrings of the code
(Python, shell, TOML) and in the docs (README.md, docs/**/*.md), and every markdown link and image of a doc.
Nothing points outside it (the notes a clone does not have), and every `docs/paper.md §N` has its section.

What counts as a citation:
- a plain path that starts with one of the repository's top-level folders (`docs/x.md`, `configs/paper/`,
  `eval/passkey.py`), resolved from the repository root, in a comment, a docstring or anywhere in a doc
  (command examples in code blocks included: they are what a reader copies);
- a markdown link `[text](target)` or image `![alt](target)` (or `<img src=...>`) of a doc, outside code
  blocks, resolved from the doc's folder. A URL or a bare `#anchor` is not a file.
Plain paths under the user-output folders (runs/, data/, hf/, out/) name what a command writes, not a file of
the repository, and are skipped; a link or image that points there is broken for every reader of the
repository (none of it is committed), so it is reported. Placeholders (RUN/, OUT/, NAME, `*`, `{...}`,
`<...>`) are not files and are skipped.
"""

import ast
import io
import os
import re
import subprocess
import tokenize
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = "tests/test_docs.py"  # it spells out the forbidden names to look for them
OUTPUT_DIRS = ("runs", "data", "hf", "out")  # what commands write; .gitignore keeps it out of the repository
WALK_SKIP = {".git", "__pycache__", ".pytest_cache", "wandb", *OUTPUT_DIRS}
# Where a plain path starts: these folders and any other top-level folder of the repository (so a citation
# of a folder that was renamed away is still read as one).
TOP_DIRS = (".ci", "bench", "configs", "docs", "eval", "tests")

# Known broken links, each naming the issue that will fix it; an entry no longer needed fails the test, so
# the list only shrinks. (doc, target prefix): reason.
# (doc, link prefix): issue, for links that are broken on purpose until an issue lands
ALLOWED_BROKEN = {}

PLACEHOLDER_PART = re.compile(r"^(?:RUN|OUT|OUT_DIR|NAME|PATH|DIR|FILE|PREFIX|SPLIT|N|X+)(?:[._].*)?$")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # [text](target "title")
                  r"|<img\b[^>]*\bsrc=[\"']([^\"']+)[\"']")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FORBIDDEN = re.compile(r"\.\./shared\b|(?<![\w./-])(?:PAPER|DESIGN|STYLE)\.md\b")
BARE_PAPER = re.compile(r"(?<![\w./-])paper\.md\b", re.IGNORECASE)  # outside docs/ only docs/paper.md exists
PAPER_SECTION = re.compile(r"docs/paper\.md\s*§\s*(\d+)")


def repository_files(root):
    """The repository's files, relative and with '/': git's view (tracked, plus new files it does not ignore)
    where there is one, else a walk that skips what .gitignore keeps out."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        files = {f for f in out.split("\0") if f}
    except (OSError, subprocess.SubprocessError):
        files = set()
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in WALK_SKIP and not d.endswith(".egg-info")]
            files.update(os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names)
    return {f for f in files if os.path.isfile(os.path.join(root, f))}  # not those deleted but not yet staged


def folders_of(files):
    return {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}


def is_doc(rel):
    return rel == "README.md" or (rel.startswith("docs/") and rel.endswith(".md"))


def is_shell(rel, text):
    return rel.endswith(".sh") or (text.startswith("#!") and "sh" in text.split("\n", 1)[0])


def python_comments(text):
    """(line, text) of every comment and docstring."""
    pieces = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                pieces.append((first.lineno, first.value.value))
    return pieces


def hash_comments(text):
    """(line, text) of the `#` comments of a shell script or TOML file."""
    pieces = []
    for number, line in enumerate(text.splitlines(), 1):
        match = re.search(r"(?:^|\s)(#.*)$", line)
        if match:
            pieces.append((number, match.group(1)))
    return pieces


def plain_paths(text, top_dirs):
    """Path-like words that start with a top-level folder of the repository, trailing punctuation removed."""
    pattern = re.compile(r"(?<![\w./~$@-])(?:\./)?((?:" + "|".join(map(re.escape, sorted(top_dirs)))
                         + r")/[^\s`'\"()\[\]|,;]*)")
    for match in pattern.finditer(text):
        path = re.sub(r"(?::\d+)+$", "", match.group(1).rstrip(".:!?*_"))
        yield path.split("#")[0]


def is_placeholder(path):
    return bool(re.search(r"[*?{}<>$]|\.\.\.|…", path)) or any(map(PLACEHOLDER_PART.match, path.split("/")))


def under_output_dir(path):
    return path.split("/")[0] in OUTPUT_DIRS


class Problem(NamedTuple):
    where: str  # file:line
    target: str  # what it cites
    why: str

    def __str__(self):
        return f"{self.where}: {self.target}: {self.why}"


def find_problems(root, files):
    """A Problem per citation of a file the repository does not have, per reference to notes outside it, and
    per `docs/paper.md §N` whose section does not exist."""
    known = files | folders_of(files)
    top_dirs = {f.split("/")[0] for f in files if "/" in f} | set(TOP_DIRS) | set(OUTPUT_DIRS)
    sections = set()
    if "docs/paper.md" in files:
        with open(os.path.join(root, "docs", "paper.md"), encoding="utf-8") as f:
            sections = set(re.findall(r"^## (\d+)\.", f.read(), re.M))
    problems = []

    def check_plain(where, text):
        for path in plain_paths(text, top_dirs):
            if not is_placeholder(path) and not under_output_dir(path) and path.rstrip("/") not in known:
                problems.append(Problem(where, path, "not in the repository"))

    for rel in sorted(files):
        if rel == THIS:
            continue
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # images and other binary files cite nothing
        for number, line in enumerate(text.splitlines(), 1):
            outside = FORBIDDEN.findall(line) + ([] if rel.startswith("docs/") else BARE_PAPER.findall(line))
            problems += [Problem(f"{rel}:{number}", bad, "outside the repository, which a clone does not "
                                 "have (the paper's account is docs/paper.md)") for bad in outside]
            problems += [Problem(f"{rel}:{number}", f"docs/paper.md §{n}", "docs/paper.md has no such section")
                         for n in PAPER_SECTION.findall(line) if n not in sections]
        if is_doc(rel):
            problems += doc_link_problems(rel, text, known)
            pieces = [(1, text)]  # all of it: prose, inline code and the commands of code blocks
        elif rel.endswith(".py"):
            pieces = python_comments(text)
        elif rel.endswith(".toml") or is_shell(rel, text):
            pieces = hash_comments(text)
        else:
            continue
        for start, piece in pieces:
            for offset, line in enumerate(piece.splitlines()):
                check_plain(f"{rel}:{start + offset}", line)
    return list(dict.fromkeys(problems))  # a link whose text is its path is one problem, not two


def doc_link_problems(rel, text, known):
    """The broken markdown links and images of a doc (outside fenced code blocks), resolved from its folder."""
    problems, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or line.lstrip().startswith(("```", "~~~")):
            continue
        for match in LINK.finditer(line):
            target = (match.group(1) or match.group(2)).split("#")[0].split("?")[0]
            if not target or URL.match(target):
                continue  # a web page, or an anchor in this doc
            path = os.path.normpath(os.path.join(os.path.dirname(rel), target)).replace(os.sep, "/")
            if path == ".." or path.startswith("../"):
                why = "outside the repository"
            elif under_output_dir(path):
                why = f"under {path.split('/')[0]}/, which is never committed"
            elif path.rstrip("/") not in known:
                why = "not in the repository"
            else:
                continue
            problems.append(Problem(f"{rel}:{number}", target, why))
    return problems


def allow_listed(problem):
    return next((issue for (doc, prefix), issue in ALLOWED_BROKEN.items()
                 if problem.where.startswith(doc + ":") and prefix in problem.target), None)


@pytest.fixture(scope="module")
def repository_problems():
    return find_problems(ROOT, repository_files(ROOT))


@pytest.mark.slow
def test_every_cited_file_exists(repository_problems):
    problems = [p for p in repository_problems if not allow_listed(p)]
    assert not problems, "broken citations:\n" + "\n".join(map(str, problems))


@pytest.mark.slow
def test_allowed_broken_links_are_still_broken(repository_problems):
    """An ALLOWED_BROKEN entry whose links were fixed must go, so that the list only shrinks."""
    for (doc, prefix), issue in ALLOWED_BROKEN.items():
        assert any(p.where.startswith(doc + ":") and prefix in p.target for p in repository_problems), \
            f"{doc} no longer links under {prefix} ({issue}): remove its ALLOWED_BROKEN entry"


def test_the_checker_finds_planted_broken_citations(tmp_path):
    """The checker itself, on a small repository with citations of every kind: it reports exactly the broken
    ones, so the test above cannot pass by finding nothing."""
    files = {
        "README.md": "See [the docs](docs/guide.md), [gone](docs/missing.md) and ![plot](docs/img.png).\n"
                     "Run `python train.py configs/there.toml`, then configs/absent.toml; see "
                     "[a site](https://example.org/x.md) and [top](#top). Results: runs/x/eval/passkey.json.\n"
                     "![a run's plot](runs/x/eval/passkey.png)\n"
                     "```bash\npython -m eval.x RUN/eval/NAME.py configs/*.toml [x](runs/y.png)\n```\n",
        "docs/guide.md": "Up: [readme](../README.md), sibling [paper](paper.md), [out](../../elsewhere.md).\n"
                         "The notes in ../shared are not ours, nor is PAPER.md; docs/paper.md §9 is not there.\n",
        "docs/paper.md": "## 1. The idea\n",
        "docs/img.png": "",
        "configs/there.toml": "# base is configs/base_missing.toml\nkey = 'configs/in_a_string.toml'\n",
        "tool.py": '"""Docstring: see bench/gone.py and eval/present.py."""\n'
                   "x = 'docs/not_a_comment.md'  # docs/also_gone.md, docs/paper.md §1, see paper.md\n",
        "eval/present.py": "",
        "run.sh": "#!/bin/bash\necho $# # see docs/sh_gone.md\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = sorted((p.where, p.target) for p in find_problems(str(tmp_path), set(files)))
    assert found == sorted([
        ("README.md:1", "docs/missing.md"),
        ("README.md:2", "configs/absent.toml"),
        ("README.md:3", "runs/x/eval/passkey.png"),
        ("docs/guide.md:1", "../../elsewhere.md"),
        ("docs/guide.md:2", "../shared"), ("docs/guide.md:2", "PAPER.md"),
        ("docs/guide.md:2", "docs/paper.md §9"),
        ("configs/there.toml:1", "configs/base_missing.toml"),
        ("tool.py:1", "bench/gone.py"), ("tool.py:2", "docs/also_gone.md"), ("tool.py:2", "paper.md"),
        ("run.sh:2", "docs/sh_gone.md"),
    ]), "\n".join(map(str, found))


# A list of the encodings written out in prose is the registry's, in its order: where a page says "a name in
# `model.ENCODINGS`: nope, rope, ...", the names that follow are model.PE_CHOICES (issue 56: two hand-written lists
# had fallen behind it).
ENCODING_LIST = re.compile(r"a name in `model\.ENCODINGS`: ([a-z0-9_, ]+)")


def test_every_encoding_list_in_the_docs_is_the_registry():
    from model import PE_CHOICES
    found = []
    for folder, _, files in os.walk(ROOT):
        if any(part.startswith(".") or part in ("runs", "data", "repro") for part in folder.split(os.sep)):
            continue
        for name in files:
            if name.endswith((".md", ".py", ".toml")):
                path = os.path.join(folder, name)
                for match in ENCODING_LIST.finditer(open(path, encoding="utf-8", errors="replace").read()):
                    names = [n.strip() for n in match[1].split(",") if n.strip()]
                    found.append((os.path.relpath(path, ROOT), names))
    assert len(found) >= 2  # docs/training.md's config table and docs/INTERFACES.md's ModelConfig
    for path, names in found:
        assert names == list(PE_CHOICES), f"{path} lists {names}; the registry has {list(PE_CHOICES)}"
