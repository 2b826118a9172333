r"""Text from a trained byte-level run after each --prompt (a clone: sample.py; docs/results.md):

    python -m jrope.sample --workdir=runs/wikitext_cpu/jordan_exact_scaled/seed0 \
        --prompt=" = Valkyria Chronicles = " --num_tokens=200 --temperature=0.8 --top_p=0.95
"""

import functools
import re

from absl import flags

from jrope import command_line

flags.DEFINE_string("workdir", None, "Trained run.", required=True)
flags.DEFINE_multi_string("prompt", None, "Prompt (repeatable).", required=True)
# Python keeps an argument's bytes that are not UTF-8 as the surrogates U+DC80 to U+DCFF.
flags.register_validator("prompt", lambda prompts: not re.search("[\udc80-\udcff]",
                         "".join(prompts or ())), "--prompt must be UTF-8 text")  # fmt: skip
flags.DEFINE_integer("num_tokens", 200, "New bytes.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "0: greedy.")
flags.register_validator(
    "temperature", lambda t: 0 <= t < float("inf"), "--temperature must be finite, >= 0"
)
flags.DEFINE_integer("top_k", 0, "0: all.", lower_bound=0)
flags.DEFINE_float("top_p", 1.0, "1: all.")
flags.register_validator("top_p", lambda p: 0 < p <= 1, "--top_p must lie in (0, 1]")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("stop_byte", -1, "-1: none.", -1, 255)
flags.DEFINE_bool("no_cache", False, "Uncached decoding.")
flags.DEFINE_integer("position_offset", 0, "First position.", lower_bound=0)
flags.DEFINE_integer("rebase_bound", 1024, "Cache rebase period.", lower_bound=1)
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    from jrope.experiments import text_generation  # here: --help and bad flags need no JAX
    from jrope.model.generation import GenerationSettings, SamplingSettings

    run = text_generation.load_text_run(FLAGS.workdir)
    stop = None if FLAGS.stop_byte < 0 else run.byte_token(FLAGS.stop_byte)
    sampling = SamplingSettings(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
    settings = GenerationSettings(FLAGS.num_tokens, sampling, stop, FLAGS.position_offset,
                                  FLAGS.rebase_bound, use_cache=not FLAGS.no_cache)  # fmt: skip
    for prompt, text in zip(FLAGS.prompt, run.generate(FLAGS.prompt, settings), strict=True):
        print(f"=== prompt {prompt!r}\n{text}" if len(FLAGS.prompt) > 1 else text)


run_main = functools.partial(command_line.run, main)
if __name__ == "__main__":
    run_main()
