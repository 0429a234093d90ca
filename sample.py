"""
Sample text from a trained model, with the KV cache (model.generate).

    python sample.py runs/tiny --prompt "The meaning of life is" --max_new_tokens 100
    python sample.py runs/bam_ssmax_512/checkpoints/step_00020000.pt --num_samples 3 --temperature 0.8 --top_k 200
    python sample.py runs/tiny --prompt_file story.txt --temperature 0       # greedy
    python sample.py runs/rope_512 --prompt_file long.txt --rope_scaling yarn --rope_factor auto

Model overrides (--window, --rope_scaling, --rope_factor, --model.key=value) work as in the evaluators
(docs/evaluation.md); a rope_factor of auto is the prompt plus the new tokens over the training context.

The prompt is encoded, and the output decoded, with the run's tokenizer (data.tokenizer). Without a prompt,
generation starts from the token every training document begins with (GPT-2's <|endoftext|>, or the BOS).
"""

import sys

import torch

from bam.cli import Parser, UserError, describe_os_error, run_cli
from bam.ranges import number
from eval.loading import load_for_eval
from eval.memory import OutOfMemory, check_fits, generation_bytes
from eval.options import add_model_arguments, overrides_label, parse_arguments


def read_prompt(path):
    """The text of a prompt file: UTF-8 text, as the tokenizer reads it (not the locale's encoding)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise UserError(describe_os_error(e, "cannot read --prompt_file")) from None
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding
        raise UserError(f"--prompt_file {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                        f"convert it, e.g. with iconv -t utf-8") from None


def main(argv=None):
    ap = Parser(prog="sample.py", description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("source", help="run directory (newest checkpoint) or checkpoint file")
    ap.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    ap.add_argument("--prompt_file", default=None, help="read the prompt from this file instead")
    ap.add_argument("--max_new_tokens", type=number(int, ">= 1"), default=100)
    ap.add_argument("--temperature", type=number(float, ">= 0"), default=0.8, help="0 = greedy (default %(default)s)")
    ap.add_argument("--top_k", type=number(int, ">= 0"), default=200, help="sample among the k most likely tokens; 0 = all")
    ap.add_argument("--num_samples", type=number(int, ">= 1, <= 10000"), default=1)
    ap.add_argument("--seed", type=number(int, ">= 0, < 4294967296"), default=0)
    add_model_arguments(ap)
    args, options = parse_arguments(ap, argv)
    if args.prompt and args.prompt_file:
        raise UserError("give --prompt or --prompt_file, not both")
    prompt = read_prompt(args.prompt_file) if args.prompt_file else args.prompt

    evaluated = load_for_eval(args.source, options)
    enc = evaluated.tokenizer()
    ids = [enc.doc_open] + enc.encode_ordinary(prompt)  # a prompt is the start of a document, as in training
    model, per_length = evaluated.at_length(len(ids) + args.max_new_tokens)
    try:  # the KV cache is allocated whole: ask for it only if it can fit
        check_fits(generation_bytes(model, args.num_samples, len(ids), args.max_new_tokens), evaluated.device,
                   f"--max_new_tokens {args.max_new_tokens:,} x --num_samples {args.num_samples} "
                   f"after {len(ids):,} prompt tokens")
    except OutOfMemory as e:
        raise UserError(f"{e}; ask for fewer tokens or samples") from None
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=evaluated.device)
    # Every sample draws from one generator, so a seed fixes all of them (and they still differ)
    generator = torch.Generator(device=evaluated.device).manual_seed(args.seed)
    label = overrides_label(evaluated.info["config"], options.model_overrides)
    factor = f" (rope_factor {per_length['rope_factor']:g})" if per_length else ""
    print(f"{evaluated.info['name']}: {label}{factor}, {evaluated.info['num_params']:,} parameters; "
          f"{len(ids)} prompt tokens", file=sys.stderr)
    with evaluated.autocast():
        out = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                             generator=generator)
    for i, row in enumerate(out.tolist()):
        if i:
            print("-" * 80)
        # Decode from after the opening token; a generated separator ends a document, shown as a marker
        text = enc.decode(row[1:])
        for marker in dict.fromkeys(enc.decode([t]) for t in enc.separators):
            text = text.replace(marker, f"\n{marker}\n")
        print(text)
    return 0


if __name__ == "__main__":
    run_cli(main, interrupted="sample.py: interrupted")
