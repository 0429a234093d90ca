"""
Export a checkpoint as a Hugging Face `transformers` folder that loads without this repository:

    python export_hf.py runs/bam_ssmax_512 hf/bam_ssmax_512        # newest checkpoint of a run
    python export_hf.py runs/bam_ssmax_512/checkpoints/best.pt hf/bam_ssmax_512_best

The folder holds config.json (with `auto_map`), model.safetensors, generation_config.json, the run's
tokenizer (data.tokenizer: for GPT-2, tokenizer.json and tokenizer_config.json built from the project's GPT-2
ranks; a Hugging Face tokenizer is saved as it loads), two Python files: model.py, copied verbatim from this
repository, and modeling_bam.py, the small wrapper that makes it a PreTrainedModel; and exported.json, written
last, which lists them all. Because the exported code *is* model.py, every encoding, Scalable-Softmax and every
config field behave exactly as in training and evaluation here; nothing is re-implemented.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf/bam_ssmax_512", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained("hf/bam_ssmax_512")

OUT_DIR is written in a temporary folder next to it and swapped in at the end (outputs.swap_in), so after
a kill at any moment OUT_DIR is the old complete export or the new one, never half of one; the next export
to OUT_DIR finishes or undoes a swap that a kill interrupted and removes what a killed export left
(.OUT_DIR.tmp-*, .OUT_DIR.new, .OUT_DIR.old). An existing OUT_DIR is replaced only with --overwrite, and only
if it is an earlier export holding nothing else: exported.json, written last, lists every file of the export,
and a folder holding anything more (a checkout of this repository has modeling_bam.py too) is refused naming
it, with nothing removed. An OUT_DIR that is the source, holds it or lies inside it (symlinks resolved) is
refused before anything is written (outputs.check_apart). While an export writes OUT_DIR it holds
.OUT_DIR.lock beside it (removed at the end): a second export to the same folder is refused. Files and folders
get the user's umask, as anything else the user writes.
"""

import argparse
import ast
import functools
import os
import shutil
import sys
from dataclasses import asdict

from bam import outputs
from bam.checkpoint import CheckpointError, checkpoint_tokenizer, load_checkpoint
from bam.cli import Parser, UserError, WriteError, run_cli
from bam.tokenizer import GPT2Tokenizer, load_run_tokenizer
from model import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_SOURCE = os.path.join(HERE, "model.py")
WRAPPER_SOURCE = os.path.join(HERE, "modeling_bam.py")
EOT_TOKEN = "<|endoftext|>"
MANIFEST = "exported.json"  # every file an export wrote: what --overwrite may replace (outputs.check_replaceable)


class ExportError(UserError):
    """A mistake the user can fix; main() prints it as one `error: ...` line."""


def check_self_contained(path):
    """model.py travels alone: at module level it may import only torch and the standard library, or the
    exported folder would need this repository after all. (Its checkpoint helpers import bam/checkpoint.py
    inside the functions, which the exported model never calls.)"""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    foreign = set()
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or "."] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        for name in names:
            top = name.split(".")[0]
            if top != "torch" and top not in sys.stdlib_module_names:
                foreign.add(top)
    if foreign:
        raise ExportError(f"{path} imports {', '.join(sorted(foreign))}; an exported model.py may import only "
                          f"torch and the standard library at module level")


def read_checkpoint(source):
    """(ModelConfig, state dict, checkpoint path, the run's Tokenizer) of a run directory or checkpoint file.
    The config is read strictly: a setting this model.py does not know would be dropped from the export. The
    tokenizer is the run's, checked as every evaluator checks it (tokenizer.load_run_tokenizer): an export
    never ships a tokenizer whose files changed since training."""
    try:
        path, ckpt = load_checkpoint(source)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    try:
        cfg = ModelConfig.from_dict(ckpt["model_config"], strict=True)
    except KeyError as e:  # a checkpoint from a newer model.py: exporting would silently drop these settings
        raise ExportError(f"{path} has {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise ExportError(f"{path}: {e}") from None
    name, recorded = checkpoint_tokenizer(ckpt)
    enc = load_run_tokenizer(name, recorded.sha256 if recorded else None, cfg.vocab_size, path)
    return cfg, ckpt["model"], path, enc


@functools.lru_cache(maxsize=None)  # converting the 50K ranks takes seconds; one conversion per process
def hf_tokenizer(enc):
    """A `transformers` fast tokenizer with exactly the ids of tiktoken's GPT-2 Encoding `enc`: the same
    byte-level BPE ranks (merges recovered from the ranks by transformers' own TikTokenConverter), the same
    pre-tokenisation regex, and <|endoftext|> as the one special token (end of text, and padding)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        def load_tiktoken_bpe(self, ranks):  # the ranks in memory, however bam/data.py obtained them
            return ranks

    converter = RanksConverter(vocab_file=enc._mergeable_ranks, pattern=enc._pat_str,
                               extra_special_tokens=enc._special_tokens)
    return PreTrainedTokenizerFast(tokenizer_object=converter.converted(), eos_token=EOT_TOKEN,
                                   bos_token=EOT_TOKEN, unk_token=EOT_TOKEN, pad_token=EOT_TOKEN,
                                   add_bos_token=False, add_eos_token=False,
                                   model_max_length=int(1e30), clean_up_tokenization_spaces=False)


def check_target(out_dir, overwrite):
    """An existing OUT_DIR is replaced only with --overwrite, and only if it is an earlier export holding nothing
    but what that export wrote (its MANIFEST lists every file: outputs.check_replaceable), or empty."""
    if os.path.lexists(out_dir):
        if not overwrite:
            raise ExportError(f"{out_dir} already exists; pass --overwrite to replace it (an earlier export only)")
        outputs.check_replaceable(out_dir, MANIFEST, "export_hf.py", ExportError, "OUT_DIR", older=older_export)


def older_export(folder):
    """Whether `folder` looks like an export of export_hf.py before it wrote MANIFEST: the wrapper and the
    weights beside a config.json (a checkout of this repository has the wrapper, but not the others)."""
    return all(os.path.isfile(os.path.join(folder, name))
               for name in ("modeling_bam.py", "model.py", "config.json", "model.safetensors"))


def lock_target(out_dir):
    """Hold .OUT_DIR.lock, then finish or undo what a killed export to OUT_DIR left (outputs.claim_folder)."""
    outputs.claim_folder(out_dir, "export_hf.py", "export", refused=ExportError)


def export(source, out_dir, overwrite=False):
    """Write the folder; returns the checkpoint path it came from."""
    out_dir = os.path.abspath(out_dir)
    # --overwrite swaps out the folder that holds the source; an OUT_DIR inside a run writes into the run
    outputs.check_apart(source, out_dir, ExportError, "RUN_OR_CHECKPOINT", "OUT_DIR")
    check_target(out_dir, overwrite)
    check_self_contained(MODEL_SOURCE)
    cfg, state, path, enc = read_checkpoint(source)
    try:  # only now: a wrong argument is answered without the seconds this import takes
        from transformers import GenerationConfig
        from transformers.dynamic_module_utils import get_class_from_dynamic_module
    except ImportError:
        raise ExportError("export_hf.py needs transformers: pip install -r requirements.txt") from None

    # Generation stops at the token that ends a document: GPT-2's EOT (which also opens one), or the EOS.
    bos = enc.doc_open
    eos = enc.doc_close if enc.doc_close is not None else enc.doc_open

    lock_target(out_dir)
    check_target(out_dir, overwrite)  # again: the recovery may have put an earlier export back
    tmp = outputs.new_folder(out_dir)
    try:
        shutil.copy(MODEL_SOURCE, os.path.join(tmp, "model.py"))
        shutil.copy(WRAPPER_SOURCE, os.path.join(tmp, "modeling_bam.py"))
        # The classes come from the copies, through the library's remote-code loader: the same code that
        # users will run builds and saves the model here.
        config_cls = get_class_from_dynamic_module("modeling_bam.BAMConfig", tmp)
        model_cls = get_class_from_dynamic_module("modeling_bam.BAMForCausalLM", tmp)
        config = config_cls(bam_model=asdict(cfg), eos_token_id=eos, bos_token_id=bos, pad_token_id=eos)
        model = model_cls(config)
        missing, unexpected = model.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ExportError(f"{path} does not match its own config: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}")
        model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=bos, pad_token_id=eos)
        model.save_pretrained(tmp)
        if isinstance(enc, GPT2Tokenizer):
            hf_tokenizer(enc.enc).save_pretrained(tmp)
        else:  # a fresh copy from its folder: the run's own instance reads special-token text as text
            from transformers import AutoTokenizer
            AutoTokenizer.from_pretrained(enc.folder, use_fast=True).save_pretrained(tmp)
        outputs.write_manifest(tmp, MANIFEST, {"written_by": "export_hf.py"})
        outputs.follow_umask(tmp)  # safetensors' file is 0600 otherwise
        outputs.swap_in(tmp, out_dir)  # in one step where the file system allows it (outputs.py)
    except Exception as e:  # a full disk or a file-size limit, in safetensors', torch's or our own words
        failure = outputs.write_failure(e, out_dir)
        if failure is None or isinstance(e, ExportError):
            raise
        kept = "the previous export is intact" if os.path.isdir(out_dir) else "nothing was written"
        raise WriteError(failure, out_dir, kept) from None
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    outputs.unlock(outputs.sibling(out_dir, "lock"))  # a failed export's lock goes when the process ends
    return path


def main(argv=None):
    ap = Parser(prog="export_hf.py", description=__doc__.split("\n\n")[0].strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run directory (newest checkpoint) or checkpoint file")
    ap.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT_DIR if it is an earlier export holding nothing else (exported.json lists it)")
    args = ap.parse_args(argv)
    path = export(args.source, args.out_dir, args.overwrite)
    print(f"exported {path} to {args.out_dir}")


if __name__ == "__main__":
    run_cli(main)
