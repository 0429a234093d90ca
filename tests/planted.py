"""A folder of the user's planted where a command writes its output: a checkout of this repository (its
top-level files, modeling_bam.py and train.py among them) and a notes file. What --overwrite must leave as it
is (issue 59: an export once replaced such a folder because it holds modeling_bam.py)."""

import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTES = "notes.md"


def checkout_like(folder):
    """`folder` made as a checkout of this repository plus the user's notes; returns snapshot(folder)."""
    os.makedirs(folder)
    for name in sorted(os.listdir(ROOT)):
        if os.path.isfile(os.path.join(ROOT, name)):
            shutil.copy(os.path.join(ROOT, name), os.path.join(folder, name))
    with open(os.path.join(folder, NOTES), "w") as f:
        f.write("what I tried today\n")
    return snapshot(folder)


def snapshot(folder):
    """Every entry under `folder`: a file's bytes, a link's target, None for a folder."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = os.readlink(path) if os.path.islink(path) else \
                open(path, "rb").read() if os.path.isfile(path) else None
    return found
