"""Evaluate a run across lengths: python -m jrope.eval --workdir=DIR (a clone: eval.py).

Its latest checkpoint, with the config saved with it (--config.<key>=<value> may change what does
not define the result; --config=<experiment> replaces it; a probe config runs the kernel probe),
at eval.lengths; the rows join DIR/eval_step<N>/eval.{csv,md,png} and metrics.jsonl at step N.
"""

import functools

from absl import flags

from jrope import command_line


def define_flags(argv: list[str]) -> str | None:
    """--config defaults to the run's saved config, so that the overrides apply to it."""
    workdir, config = (command_line.flag_argument(argv, name) for name in ("workdir", "config"))
    if workdir and not config:
        from jrope import saved_run_config  # here: without the 'train' extra, it is named

        config = saved_run_config.config_file(workdir)
    return command_line.define_run_flags(config)


def main(argv: list[str]) -> None:
    from jrope import saved_run_config
    from jrope.train.checkpoints import check_changes
    from jrope.train.config import TrainConfig  # here: --help and a bad flag need no JAX
    from jrope.train.trainer import evaluate_checkpoint

    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    if "probe" in config:
        from jrope.experiments import kernel_probe

        return kernel_probe.run(config, workdir)
    if not flags.FLAGS["config"].present:  # what defines the result may not change
        saved = saved_run_config.saved_config_path(workdir).parent.parent
        check_changes(
            saved, saved_run_config.read_saved_config(saved), config.to_dict(), "evaluate"
        )
    evaluate_checkpoint(TrainConfig.from_config_dict(config), workdir)


run_main = functools.partial(command_line.run, main, define_flags)
if __name__ == "__main__":
    run_main()
