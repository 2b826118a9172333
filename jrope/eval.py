"""Evaluate a run across lengths: python -m jrope.eval --workdir=DIR (a clone: eval.py).

Its latest checkpoint, with the config saved with it (--config.<key>=<value> may change what does
not change the model; --config=<experiment> replaces it; a probe config runs the kernel probe),
at eval.lengths; the rows join DIR/eval_step<N>/eval.{csv,md,png} and metrics.jsonl at step N.
"""

from absl import flags

from jrope import command_line
from jrope.errors import ConfigError


def define_flags(argv: list[str]) -> None:
    """--config defaults to the run's saved config, so that the overrides apply to it."""
    workdir, config = (command_line.flag_argument(argv, name) for name in ("workdir", "config"))
    saved = None
    if workdir and not config:
        from jrope import saved_run_config  # here: an install without the 'train' extra is told

        saved = saved_run_config.config_file(workdir)
    command_line.define_run_flags(saved)


def main(argv: list[str]) -> None:
    command_line.start_processes()
    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    if "probe" not in config:
        from jrope.train.config import TrainConfig  # here: a bad flag is told without JAX
        from jrope.train.evaluation import evaluate_checkpoint

        evaluate_checkpoint(TrainConfig.from_config_dict(config), workdir)
        return
    from jrope.experiments import kernel_probe

    try:
        kernel_probe.KernelProbeConfig.from_config_dict(config)
    except ValueError as error:
        raise ConfigError(str(error).splitlines()) from error
    kernel_probe.run(config, workdir)


def run_main() -> None:
    command_line.run(main, define_flags)  # python -m jrope.eval, jrope-eval, or a clone's eval.py


if __name__ == "__main__":
    run_main()
