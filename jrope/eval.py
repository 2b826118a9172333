"""Evaluate a run across lengths: python -m jrope.eval --workdir=DIR [--config.eval.lengths='(256,4096)'].

In a clone, python eval.py with the same flags; the console script jrope-eval too.

Evaluates the latest checkpoint in DIR with the config saved in it (no
--config needed), at config.eval.lengths. Its rows join DIR/eval_step<N>/eval.{csv,md,png}
by length (a length evaluated again takes the newer row), and go to the run's
metrics.jsonl and TensorBoard as eval_<length>/<metric> at step N, the names of the
training run's own evaluations. `--config.<key>=<value>` changes a key
of that config: the evaluation settings (eval.lengths, eval.num_sequences,
eval.batch_size) freely; a change to the model, its encoding, the data source
or the seed is refused with the difference.

--config=<experiment> (a name such as kernel_probe, or a config file's path)
evaluates with that config instead (it must describe the same model). A probe
config (one `probe` section, configs/kernel_probe*.py) runs the closed-form
kernel probe, which trains no model. Errors end with their message and an
exit status per kind (jrope.command_line). Multi-process runs take the process
flags of training.
"""

from absl import flags
from ml_collections import config_flags

from jrope import command_line, saved_run_config
from jrope.command_line import config_argument
from jrope.errors import ConfigError, NoCheckpointError, UsageError

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory holding the run (and receiving results)."
)
command_line.define_process_flags()
flags.mark_flags_as_required(["workdir"])


def define_config_flag(argv: list[str]) -> None:
    """Defines --config, its default the config saved with the latest checkpoint in argv's
    --workdir (None without one), so that `--config.<key>=<value>` overrides apply to it as
    to any config file: ml_collections reads them against the flag's value when it is defined."""
    workdir = config_argument(argv, "workdir")
    step = None if workdir is None else saved_run_config.latest_saved_config(workdir)[0]
    config_flags.DEFINE_config_file(
        "config",
        None if step is None else f"{saved_run_config.__file__}:{workdir}",
        "Experiment config (its name or file); default: the one saved with the run's latest "
        "checkpoint.",
        lock_config=True,
    )


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"Unexpected arguments: {argv[1:]}")
    config = flags.FLAGS.config
    if config is None:
        raise NoCheckpointError(saved_run_config.no_saved_config_message(_WORKDIR.value))
    command_line.start_processes()  # before anything starts a JAX backend
    if "probe" in config:
        # Imported only here: the probe needs no trained model.
        from jrope.experiments import kernel_probe

        try:
            kernel_probe.KernelProbeConfig.from_config_dict(config)
        except ValueError as error:
            raise ConfigError(str(error).splitlines()) from error
        kernel_probe.run(config, _WORKDIR.value)
        return
    from jrope.train.evaluation import evaluate_checkpoint

    evaluate_checkpoint(config, _WORKDIR.value)


def run_main() -> None:
    """The command line: python -m jrope.eval, jrope-eval, or a clone's eval.py."""
    command_line.run(main, usage=__doc__, define_flags=define_config_flag)


if __name__ == "__main__":
    run_main()
