"""Evaluate across lengths: python eval.py --config=configs/<experiment>.py --workdir=<dir>.

For a trained experiment, evaluates the latest checkpoint in <workdir> at
config.eval.lengths and writes <workdir>/eval_step<N>/eval.{csv,md,png}
(eval_step<N>.2, .3, ... when that already holds results: nothing is overwritten).
A probe config (one `probe` section, configs/kernel_probe*.py) runs the
closed-form kernel probe instead. Multi-process runs take the process flags
of train.py (jrope.train.distributed).
"""

from absl import app, flags
from ml_collections import config_flags

from jrope.train import distributed, huge_pages
from jrope.train.config import TrainConfig

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory holding the run (and receiving results)."
)
_PROCESS_FLAGS = distributed.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    distributed.initialize_from_flags(_PROCESS_FLAGS)  # before anything starts a JAX backend
    config = _CONFIG.value
    if "probe" in config:
        # Imported only here: the probe needs no trained model.
        from jrope.experiments import kernel_probe

        kernel_probe.run(config, _WORKDIR.value)
        return
    from jrope.train.evaluation import evaluate_checkpoint

    evaluate_checkpoint(TrainConfig.from_config_dict(config), _WORKDIR.value)


if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()
    app.run(main)
