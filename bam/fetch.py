"""The set-up step: `python -m bam.fetch` fetches, once, what the repository needs from outside, so that
nothing downloads on first use later, neither a test (tests/conftest.py refuses to start without it, and no
test reaches the network) nor a run on a machine that is offline by then.

What it fetches is GPT-2's BPE ranks (gpt2.tiktoken, 0.8 MB), from the openai-whisper sdist on PyPI, into
bam.tokenizer.gpt2_tiktoken_cache_path() ($BAM_GPT2_TIKTOKEN, else $XDG_CACHE_HOME/bam/ or ~/.cache/bam/):
the package registry is what the installs have just reached, where tiktoken's own download (a blob store)
may be out of reach. Nothing else is fetched on first use: the suite, run with empty caches and no network,
builds its Hugging Face tokenizers, models and datasets from local files (docs/INTERFACES.md, "What the tests
check"). A tokenizer or dataset a user names on the Hub is fetched by the command that names it.

scripts/setup.sh runs it after the installs (and so do scripts/test.sh, scripts/quickstart.sh and .ci/run).
Quiet when the ranks are there (their sha256 checked), one line when it has fetched them, and one `error:` line
with the fix when the registry cannot be reached.
"""

import os
import subprocess

from bam.cli import Parser, UserError, run_cli
from bam.tokenizer import (WHISPER_SDIST, download_gpt2_tiktoken, gpt2_ranks_by_hand, gpt2_tiktoken_cache_path,
                           load_gpt2_from_file)


def fetch_gpt2_ranks():
    """GPT-2's ranks at gpt2_tiktoken_cache_path(), fetched unless they are there; UserError, one line."""
    path = gpt2_tiktoken_cache_path()
    fetch = not os.path.exists(path)
    if fetch:
        try:
            download_gpt2_tiktoken(path)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            raise UserError(f"cannot fetch GPT-2's ranks from the package registry ({e}); fix: let pip reach "
                            f"PyPI (the index and proxy that `pip install -r requirements.txt` used), or "
                            f"{gpt2_ranks_by_hand(path)}") from None
    try:
        load_gpt2_from_file(path)
    except RuntimeError as e:  # a torn or foreign file that was there before
        raise UserError(e) from None
    if fetch:
        print(f"fetched GPT-2's ranks from PyPI ({WHISPER_SDIST}) into {path}")
    return path


def main(argv=None):
    parser = Parser(prog="python -m bam.fetch", description=(
        "The set-up step: fetch what the repository needs from outside (GPT-2's tokenizer ranks, from PyPI), "
        "so that the tests and offline runs never download. Does nothing when it is there."))
    parser.parse_args(argv)
    fetch_gpt2_ranks()


if __name__ == "__main__":
    run_cli(main)
