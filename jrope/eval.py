"""Evaluate a run's latest checkpoint at eval.lengths: python -m jrope.eval --workdir=DIR; its saved
config is the default --config, and a probe config runs the kernel probe (docs/runs.md)."""

import functools

from absl import flags

from jrope import command_line


def define_flags(argv: list[str]) -> str | None:
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
        before = saved_run_config.read_saved_config(saved)
        check_changes(saved, before, config.to_dict(), "evaluate")
    evaluate_checkpoint(TrainConfig.from_config_dict(config), workdir)


run_main = functools.partial(command_line.run, main, define_flags)
if __name__ == "__main__":
    run_main()
