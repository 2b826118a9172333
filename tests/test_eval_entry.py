"""eval.py as a user runs it after train.py: the run's own config from its checkpoint, no --config.

One tiny run is trained as a subprocess; eval.py is then pointed at it with and without
overrides, as the README shows (tests/helpers/train_process.py).
"""

import json

import pytest
from helpers.tiny_config import tiny_config
from helpers.train_process import RUN_CONFIG, run_command, subprocess_env

from jrope import saved_run_config
from jrope.errors import CheckpointError
from jrope.train.checkpoints import Checkpointer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir, env, the train command's stdout) of a 16-step run with two overrides."""
    tmp = tmp_path_factory.mktemp("eval_entry")
    env = subprocess_env(1)
    workdir = tmp / "run"
    args = [f"--config={RUN_CONFIG}", "--config.num_steps=16", "--config.eval.num_sequences=16"]
    result = run_command(["train.py", *args, f"--workdir={workdir}"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir, env, result.stdout


@pytest.mark.slow
def test_the_readme_eval_command_runs_without_a_config(trained):
    workdir, env, _ = trained
    result = run_command(["eval.py", f"--workdir={workdir}", "--config.eval.lengths=(8,16)"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "length 16:" in result.stdout  # the next longer length, 2x the run's 8
    # The saved config is used: the run's 16 evaluation sequences, and no warning about settings.
    assert "(16 sequences each)" in result.stdout
    assert "changed settings" not in result.stdout + result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("W")]


@pytest.mark.slow
def test_eval_settings_change_freely_and_a_model_change_is_refused_for_an_evaluation(trained):
    workdir, env, _ = trained
    lengths = run_command(
        ["eval.py", f"--workdir={workdir}", "--config.eval.lengths=(8,24)"]
        + ["--config.eval.num_sequences=8", "--config.eval.batch_size=4"],
        env,
    )
    assert lengths.returncode == 0, lengths.stdout + lengths.stderr
    assert "length 24:" in lengths.stdout and "(8 sequences each)" in lengths.stdout
    assert "changed settings" not in lengths.stdout + lengths.stderr
    # The lengths join the run's metrics under the names the training run gives its own.
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert any(record["step"] == 16 and "eval_24/loss" in record for record in records)

    model = run_command(["eval.py", f"--workdir={workdir}", "--config.model.num_layers=2"], env)
    assert model.returncode == 4, model.stdout + model.stderr
    assert "model.num_layers is 1 there, 2 now" in model.stderr
    assert "another --workdir" not in model.stderr and "Traceback" not in model.stderr


@pytest.mark.slow
def test_a_workdir_without_a_checkpoint_is_refused_with_or_without_overrides(tmp_path):
    env = subprocess_env(1)
    for overrides in ([], ["--config.eval.lengths=(64,)"]):
        result = run_command(["eval.py", f"--workdir={tmp_path}/empty", *overrides], env)
        assert result.returncode == 4, result.stdout + result.stderr
        assert result.stderr.endswith("holds no finished checkpoint; point it at a trained run.\n")


def test_the_saved_config_is_the_latest_checkpoint_s(tmp_path):
    import jax.numpy as jnp

    for num_steps in (4, 8):  # two runs' configs in one folder: the later checkpoint's is read
        cfg = tiny_config(num_steps=num_steps)
        checkpointer = Checkpointer(
            str(tmp_path / "checkpoints"),
            every_steps=1,
            max_to_keep=2,
            config_json=cfg.to_json_dict(),
        )
        checkpointer.save(num_steps, {"x": jnp.zeros(2)}, force=True)
        checkpointer.wait_until_finished()
        checkpointer.close()
    config = saved_run_config.get_config(str(tmp_path))
    assert config.num_steps == 8
    assert config.eval.lengths == tiny_config().eval.lengths  # a tuple, as configs write it
    assert type(config.mesh.rules) is tuple
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        saved_run_config.get_config(str(tmp_path / "elsewhere"))


@pytest.mark.slow
def test_a_change_of_the_task_is_refused_in_one_line_and_the_run_s_rows_stay(trained):
    workdir, env, _ = trained
    outputs = sorted(workdir.glob("eval_step*/*")) + [workdir / "metrics.jsonl"]
    before = {path: path.read_bytes() for path in outputs}
    for override, line in [
        (
            "--config.data.kernel=damped_mixed",
            "data.kernel is 'mixed_raw' there, 'damped_mixed' now",
        ),
        ("--config.data.source=signal", "data.source is 'synthetic' there, 'signal' now"),
    ]:
        result = run_command(["eval.py", f"--workdir={workdir}", override], env)
        assert result.returncode == 4, result.stdout + result.stderr
        assert len(result.stderr.splitlines()) == 1 and line in result.stderr, result.stderr
    assert {path: path.read_bytes() for path in outputs} == before


@pytest.mark.slow
def test_an_override_given_twice_takes_the_last_value_lists_included(trained):
    workdir, env, _ = trained
    lengths = ["--config.eval.lengths=(8,16)", "--config.eval.lengths=(24,)"]
    result = run_command(["eval.py", f"--workdir={workdir}", *lengths], env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "length 24:" in result.stdout and "length 16:" not in result.stdout
    emptied = run_command(
        ["eval.py", f"--workdir={workdir}", lengths[0], "--config.eval.lengths=()"], env
    )
    assert emptied.returncode == 2 and "eval.lengths must be a non-empty tuple" in emptied.stderr
