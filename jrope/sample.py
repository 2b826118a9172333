r"""Generate text from a trained byte-level run: python -m jrope.sample --workdir=DIR --prompt="...".

In a clone, python sample.py with the same flags; the console script jrope-sample too.

Loads the latest checkpoint in DIR (the run's config comes from the
checkpoint; the training data are not needed) and prints, for each
--prompt, the text generated after it (bytes decoded as UTF-8, invalid
sequences replaced). Logs go to stderr, the text alone to stdout.

    python -m jrope.sample --workdir=runs/wikitext_cpu/jordan_exact_scaled/0 \
        --prompt=" = Valkyria Chronicles = " --num_tokens=200 --temperature=0.8 --top_p=0.95

Checks: --no_cache generates by running the full forward over the whole
sequence for every token (slow; the reference answer), and
--position_offset=P starts the prompts at absolute position P. With
--temperature=0 both must print the same text as the cached default.
"""

from absl import flags

from jrope import command_line
from jrope.errors import UsageError

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory of a trained text run.")
_PROMPTS = flags.DEFINE_multi_string(
    "prompt", None, "Prompt text; repeat the flag for a batch of prompts (any lengths)."
)
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 200, "New bytes per prompt.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "Sampling temperature; 0 is greedy.", lower_bound=0.0
)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely bytes (0: all).", lower_bound=0)
_TOP_P = flags.DEFINE_float(
    "top_p", 1.0, "Keep the most likely bytes up to this total probability (1: all)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the draws.")
_STOP_BYTE = flags.DEFINE_integer(
    "stop_byte", -1, "Stop a prompt's text after this byte, e.g. 10 (newline); -1: never.",
    lower_bound=-1, upper_bound=255,
)  # fmt: skip
_NO_CACHE = flags.DEFINE_bool(
    "no_cache", False, "Recompute the full forward for every token (the reference answer)."
)
_POSITION_OFFSET = flags.DEFINE_integer(
    "position_offset", 0, "Absolute position of each prompt's first byte.", lower_bound=0
)
_REBASE_BOUND = flags.DEFINE_integer(
    "rebase_bound", 1024, "The KV cache moves its origin every this many positions.", lower_bound=1
)
flags.mark_flags_as_required(["workdir", "prompt"])


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"Unexpected arguments: {argv[1:]}")
    # Imported here so that --help and flag errors need no JAX start-up.
    from jrope.experiments import text_generation
    from jrope.model.generation import GenerationSettings, SamplingSettings

    try:
        sampling = SamplingSettings(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _SEED.value)
    except ValueError as err:  # names the flag and its fix
        raise UsageError(str(err)) from None
    run = text_generation.load_text_run(_WORKDIR.value)
    settings = GenerationSettings(
        num_tokens=_NUM_TOKENS.value,
        sampling=sampling,
        stop_token=None if _STOP_BYTE.value < 0 else run.byte_token(_STOP_BYTE.value),
        position_offset=_POSITION_OFFSET.value,
        rebase_bound=_REBASE_BOUND.value,
        use_cache=not _NO_CACHE.value,
    )
    texts = run.generate(_PROMPTS.value, settings)
    for index, text in enumerate(texts):
        if len(texts) > 1:
            print(f"=== prompt {index}: {_PROMPTS.value[index]!r}")
        print(text)


def run_main() -> None:
    """The command line: python -m jrope.sample, jrope-sample, or a clone's sample.py."""
    command_line.run(main, usage=__doc__)


if __name__ == "__main__":
    run_main()
