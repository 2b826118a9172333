"""The commands (docs/runs.md): each defines its flags as it starts, for its --help to list its
own, and imports JAX and the 'train' extra in its main alone (command_line.run)."""

import functools
import re

from absl import flags

from jrope import command_line

FLAGS = flags.FLAGS


def _train(argv: list[str]) -> None:
    from jrope.train.config import TrainConfig
    from jrope.train.trainer import train_and_evaluate

    train_and_evaluate(TrainConfig.from_config_dict(FLAGS.config), FLAGS.workdir)


def _eval_flags(argv: list[str]) -> str | None:
    """--config defaults to the run's saved config, so that the overrides apply to it."""
    workdir, config = (command_line.flag_argument(argv, name) for name in ("workdir", "config"))
    if workdir and not config:
        from jrope import saved_run_config

        config = saved_run_config.config_file(workdir)
    return command_line.define_run_flags(config)


def _eval(argv: list[str]) -> None:
    from jrope import saved_run_config
    from jrope.experiments import kernel_probe
    from jrope.train.checkpoints import check_changes
    from jrope.train.config import TrainConfig
    from jrope.train.trainer import evaluate_checkpoint

    if "probe" in FLAGS.config:
        return kernel_probe.run(FLAGS.config, FLAGS.workdir)
    if not FLAGS["config"].present:  # what defines the result may not change
        saved = saved_run_config.saved_config_path(FLAGS.workdir).parent.parent
        before = saved_run_config.read_saved_config(saved)
        check_changes(saved, before, FLAGS.config.to_dict(), "evaluate")
    evaluate_checkpoint(TrainConfig.from_config_dict(FLAGS.config), FLAGS.workdir)


def _compare_flags(argv: list[str]) -> None:
    command_line.define_run_flags()
    flags.DEFINE_list("methods", None, "Encoding names.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds.")


def _compare(argv: list[str]) -> None:
    from jrope.experiments import compare

    compare.main(argv)


def _sample_flags(argv: list[str]) -> None:
    flags.DEFINE_string("workdir", None, "Trained run.", required=True)
    flags.DEFINE_multi_string("prompt", None, "Prompt text.", required=True)
    # Python keeps an argument's bytes that are not UTF-8 as the surrogates U+DC80 to U+DCFF.
    flags.register_validator("prompt", lambda prompts: not re.search("[\udc80-\udcff]",
                             "".join(prompts or ())), "--prompt must be UTF-8 text")  # fmt: skip
    flags.DEFINE_integer("num_tokens", 200, "New bytes.", lower_bound=1)
    flags.DEFINE_float("temperature", 1.0, "Temperature; 0: greedy.")
    flags.DEFINE_integer("top_k", 0, "Top-k; 0: all.", lower_bound=0)
    flags.DEFINE_float("top_p", 1.0, "Top-p; 1: all.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("stop_byte", -1, "Stop byte; -1: none.", -1, 255)
    flags.DEFINE_bool("no_cache", False, "Uncached decoding.")
    flags.DEFINE_integer("position_offset", 0, "First position.", lower_bound=0)
    flags.DEFINE_integer("rebase_bound", 1024, "Cache rebase period.", lower_bound=1)


def _sample(argv: list[str]) -> None:
    from jrope.experiments import text_generation
    from jrope.model.generation import GenerationSettings, SamplingSettings

    sampling = SamplingSettings(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
    run = text_generation.load_text_run(FLAGS.workdir)
    stop = None if FLAGS.stop_byte < 0 else run.byte_token(FLAGS.stop_byte)
    settings = GenerationSettings(FLAGS.num_tokens, sampling, stop, FLAGS.position_offset,
                                  FLAGS.rebase_bound, use_cache=not FLAGS.no_cache)  # fmt: skip
    for prompt, text in zip(FLAGS.prompt, run.generate(FLAGS.prompt, settings), strict=True):
        print(f"=== prompt {prompt!r}\n{text}" if len(FLAGS.prompt) > 1 else text)


train = functools.partial(command_line.run, _train, lambda argv: command_line.define_run_flags())
evaluate = functools.partial(command_line.run, _eval, _eval_flags)
compare = functools.partial(command_line.run, _compare, _compare_flags)
sample = functools.partial(command_line.run, _sample, _sample_flags)
