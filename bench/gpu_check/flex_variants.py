"""flex_variants: the flex kernels the paper's default does not reach, each once on tiny shapes before train.py
runs: a 2-layer model with head_dim 48 at T = 384 with documents, bf16, forward and backward against the eager
reference: BAM + SSMax read from its table, FIRE + SSMax and FoX + SSMax (priors of token features), BAM + SSMax
with learned sinks and gates, and a local/global layer pattern (RoPE windows, BAM + SSMax global). On a CPU, flex
has no backward: the forward is compared (the kernels traced by aot_eager, see common.flex_kernels_traced_by)."""

from bench.gpu_check.common import ATTENTION_SWITCHES, LAYER_PATTERNS, correctness_model, path_against_eager
from bench.gpu_check.report import Case, Section

VARIANTS = {
    "bam+ssmax (table)": dict(pe="bam", ssmax=True, flex_prior="table"),
    "fire+ssmax": dict(pe="fire", ssmax=True),
    "fox+ssmax": dict(pe="fox", ssmax=True),
    "bam+ssmax " + " ".join(ATTENTION_SWITCHES): dict(pe="bam", ssmax=True, switches=ATTENTION_SWITCHES),
    "pattern bam+ssmax-global": LAYER_PATTERNS["bam+ssmax-global"],
}


def plan(s):
    dtype = s.bf16

    def case(kw):
        return path_against_eager(s, correctness_model(s, **kw), "flex", True, dtype, s.cuda)

    # a flex kernel per variant with its backward, ~10 s of Triton each; the pattern compiles two
    return [Case(f"flex {name} docs {str(dtype).removeprefix('torch.')}",
                 1 if s.quick else (15 if name.startswith("pattern") else 10), lambda kw=kw: case(kw))
            for name, kw in VARIANTS.items()]


SECTION = Section("flex_variants", plan, default=True,
                  what="tiny shapes, flex fwd+bwd against eager: BAM + SSMax table, FIRE + SSMax, FoX + SSMax, "
                       "sinks + gates, a local/global pattern")
