"""Evaluate across lengths: python eval.py --config=configs/<experiment>.py --workdir=<dir>.

For a trained experiment, evaluates the latest checkpoint in <workdir> at
config.eval.lengths and writes <workdir>/eval_step<N>/eval.{csv,md,png}
(eval_step<N>.2, .3, ... when that already holds results: nothing is overwritten).
A probe config (one `probe` section, configs/kernel_probe*.py) runs the
closed-form kernel probe instead. Errors end with their message and an exit
status per kind (jrope.train.runtime). Multi-process runs take the process flags
of train.py (jrope.train.setup).
"""

from absl import flags
from ml_collections import config_flags

from jrope.errors import ConfigError, UsageError
from jrope.train import runtime, setup

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory holding the run (and receiving results)."
)
_PROCESS_FLAGS = setup.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"Unexpected arguments: {argv[1:]}")
    setup.initialize_from_flags(_PROCESS_FLAGS)  # before anything starts a JAX backend
    config = _CONFIG.value
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


if __name__ == "__main__":
    runtime.run(main)
