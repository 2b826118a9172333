"""The checks before step 1 (jrope.train.setup.check_run, after the config's own): one message
per problem, naming the key and the fix, all at once."""

import os
import re
import sys

import pytest
from absl import flags
from helpers.tiny_config import tiny_config_dict
from ml_collections import config_flags

from configs import wikitext_cpu
from jrope import flops
from jrope.errors import CheckpointError, ConfigError, DataError
from jrope.train import setup
from jrope.train.config import TrainConfig, convert_config
from jrope.train.setup import RunEnvironment, check_run
from jrope.train.trainer import evaluate_checkpoint, train_and_evaluate

GIB = 2**30
EIGHT_CPUS = RunEnvironment(num_devices=8, process_count=1, platform="cpu")
TWO_HOSTS = RunEnvironment(num_devices=8, process_count=2, platform="cpu")
THREE_HOSTS = RunEnvironment(num_devices=6, process_count=3, platform="cpu")
ONE_GPU = RunEnvironment(num_devices=1, process_count=1, platform="gpu")
ONE_CPU = RunEnvironment(num_devices=1, process_count=1, platform="cpu")


def _problem_text(config_dict, workdir, env=EIGHT_CPUS, *, evaluation=False) -> str:
    """The message of the first check that fails (conversion, then the run checks); '' if none."""
    try:
        cfg = TrainConfig.from_config_dict(config_dict)
        check_run(cfg, str(workdir), env, evaluation=evaluation)
    except (ValueError, CheckpointError) as err:
        return str(err)
    return ""


def _tiny(**overrides):
    return tiny_config_dict(**{"mesh.data": -1, **overrides})


def _text_config(**overrides):
    """The WikiText-2 CPU config on local text: this file stands in for the evaluation text.

    overrides: data keys by name (path=...), others by section (**{"model.readout": ...}).
    """
    config = wikitext_cpu.get_config()
    config.data.source = "text"
    config.data.eval_path = __file__
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (config[section] if section else config.data)[name] = value
    return config


# (id, config dict, environment, workdir kind, expected message pattern)
BAD_INPUTS = [
    (
        "unknown_encoding",
        _tiny(**{"pe.name": "jordan_ropee"}),
        EIGHT_CPUS,
        "fresh",
        r"pe\.name: unknown position-encoding name 'jordan_ropee'; did you mean jordan_rope\?",
    ),
    (
        "order3_block_does_not_divide_head_dim",
        _tiny(**{"pe.name": "jordan_m3"}),
        EIGHT_CPUS,
        "fresh",
        (r"model\.d_model = 32: jordan_m3 needs d_model / num_heads \(16\) a multiple of 6\."),
    ),
    (
        "direct_sum_needs_multiple_of_8",
        _tiny(**{"pe.name": "direct_sum", "model.d_model": 24}),
        EIGHT_CPUS,
        "fresh",
        r"direct_sum needs d_model / num_heads \(12\) a multiple of 8\.",
    ),
    (
        "encoding_settings",
        _tiny(**{"pe.init_eta": 0.5}),
        EIGHT_CPUS,
        "fresh",
        r"pe: PEConfig 'jordan_rope': \|init_eta\|=0\.5 exceeds eta_max=0\.1; raise eta_max",
    ),
    (
        "d_model_not_multiple_of_heads",
        _tiny(**{"model.num_heads": 3}),
        EIGHT_CPUS,
        "fresh",
        r"model\.num_heads must divide d_model = 32, got 3\.",
    ),
    (
        "training_length_not_positive",
        _tiny(**{"pe.train_context": 0}),
        EIGHT_CPUS,
        "fresh",
        r"pe\.train_context must be an integer in \[1, 2147483647\], got 0\.",
    ),
    (
        "eval_length_too_short",
        _tiny(**{"eval.lengths": (1, 16)}),
        EIGHT_CPUS,
        "fresh",
        r"eval\.lengths must be a non-empty tuple of distinct integers in \[2, 2147483647\], got \(1, 16\)",
    ),
    (
        "batch_not_divisible_by_data_parallel",
        _tiny(batch_size=12),
        EIGHT_CPUS,
        "fresh",
        (r"batch_size = 12 does not split over the 8 data-parallel devices; set a multiple of 8\."),
    ),
    (
        "mesh_product_not_device_count",
        _tiny(**{"mesh.data": 2}),
        EIGHT_CPUS,
        "fresh",
        r"mesh\.data, fsdp, tensor = 2, 1, 1 do not fit 8 devices; set sizes >= 1 that multiply to 8, "
        r"or one to -1\.",
    ),
    (
        "mesh_fixed_axes_do_not_divide_devices",
        _tiny(**{"mesh.tensor": 3}),
        EIGHT_CPUS,
        "fresh",
        r"mesh\.data, fsdp, tensor = -1, 1, 3 do not fit 8 devices",
    ),
    (
        "mesh_size_zero",
        _tiny(**{"mesh.fsdp": 0}),
        EIGHT_CPUS,
        "fresh",
        r"mesh\.data, fsdp, tensor = -1, 0, 1 do not fit 8 devices; set sizes >= 1",
    ),
    (
        "xla_attention_cannot_add_alibi",
        _tiny(**{"pe.name": "alibi", "model.attention_impl": "xla"}),
        EIGHT_CPUS,
        "fresh",
        r"model\.attention_impl = 'xla' at length \d+: attention_impl='xla' does not apply: the xla "
        r"kernel does not compute alibi's logit bias; the kernels that do: einsum, blockwise",
    ),
    (
        "workdir_is_a_file",
        _tiny(),
        EIGHT_CPUS,
        "file",
        r"--workdir .*/a_file: .*/a_file is no folder you can write to\.",
    ),
    (
        "workdir_below_a_file",
        _tiny(),
        EIGHT_CPUS,
        "below_file",
        r"--workdir .*/a_file/run: .*/a_file is no folder you can write to",
    ),
    (
        "evaluation_without_checkpoints",
        _tiny(),
        EIGHT_CPUS,
        "evaluate_empty",
        r"--workdir .* holds no finished checkpoint; point it at a trained run\.",
    ),
    (
        "text_dataset_missing",
        _text_config(path="/nonexistent/train.txt"),
        EIGHT_CPUS,
        "fresh",
        r"data\.path = '/nonexistent/train\.txt' does not exist; point --config\.data\.path at a UTF-8 text file",
    ),
    (
        "multi_process_eval_batch_not_split",
        _tiny(),
        TWO_HOSTS,
        "fresh",
        r"eval\.batch_size = 4 does not split over the 8 data-parallel devices",
    ),
    (
        "eval_batch_does_not_split_over_processes",
        _tiny(batch_size=6, **{"eval.num_sequences": 6, "eval.batch_size": 2}),
        THREE_HOSTS,
        "fresh",
        r"eval\.batch_size = 2 does not split over the 3 processes; set a multiple of 3",
    ),
    (
        "unknown_config_key",
        _tiny(**{"model.dropout": 0.1}),
        EIGHT_CPUS,
        "fresh",
        r"model\.dropout: no such key; did you mean model\.dropout_rate\?",
    ),
    (
        "unknown_nonfinite_policy",
        _tiny(**{"opt.nonfinite": "ignore"}),
        EIGHT_CPUS,
        "fresh",
        r"opt\.nonfinite = 'ignore' is not one of \('stop', 'skip'\)",
    ),
    (
        "last_position_readout_of_a_language_model",
        _text_config(path=__file__, **{"model.readout": "last"}),
        EIGHT_CPUS,
        "fresh",
        r"model\.readout = 'last' ignores weighted positions; set 'all'\.",
    ),
    (
        "no_steps",
        _tiny(num_steps=0),
        EIGHT_CPUS,
        "fresh",
        r"num_steps must be an integer in \[1, 2147483647\], got 0\.",
    ),
]


def _workdir(kind: str, tmp_path) -> str:
    if kind in ("file", "below_file"):
        a_file = tmp_path / "a_file"
        a_file.write_text("not a directory")
        return str(a_file / "run") if kind == "below_file" else str(a_file)
    (tmp_path / "run").mkdir()
    return str(tmp_path / "run")


@pytest.mark.parametrize(
    "config_dict, env, workdir_kind, expected",
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_reported_with_key_and_fix(config_dict, env, workdir_kind, expected, tmp_path):
    message = _problem_text(
        config_dict,
        _workdir(workdir_kind, tmp_path),
        env,
        evaluation=workdir_kind == "evaluate_empty",
    )
    assert re.search(expected, message), message


def test_good_configs_pass(tmp_path):
    assert _problem_text(_tiny(), tmp_path / "new" / "run") == ""
    # Long evaluations are fine once 'auto' switches to blockwise attention (from 4096 on by default).
    assert _problem_text(_tiny(**{"eval.lengths": (16, 65536)}), tmp_path / "run") == ""
    assert (
        _problem_text(
            _tiny(**{"eval.batch_size": 8, "eval.num_sequences": 8}), tmp_path / "run", TWO_HOSTS
        )
        == ""
    )


def test_all_problems_are_reported_together(tmp_path):
    (tmp_path / "a_file").write_text("")
    config = _tiny(**{"mesh.tensor": 3})
    with pytest.raises(ConfigError) as caught:
        check_run(TrainConfig.from_config_dict(config), str(tmp_path / "a_file"), EIGHT_CPUS)
    problems = caught.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("mesh.data, fsdp, tensor = -1, 1, 3")
    assert "a_file is no folder you can write to" in problems[1]
    assert str(caught.value).startswith("Found before compiling (docs/runs.md):\n  - mesh")
    # Conversion errors of different sections come together too.
    with pytest.raises(ValueError) as caught:
        TrainConfig.from_config_dict(
            _tiny(**{"model.compute_dtype": "float16", "opt.schedule": "linear"})
        )
    assert "model.compute_dtype = 'float16' is not one of" in str(caught.value)
    assert "opt.schedule = 'linear' is not one of" in str(caught.value)


def test_entry_points_check_before_building_anything(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"pe\.name: unknown position-encoding name 'ropee'"):
        train_and_evaluate(
            TrainConfig.from_config_dict(_tiny(**{"pe.name": "ropee"})), str(workdir)
        )
    assert not workdir.exists()  # stopped before the checkpointer or the logger created anything
    with pytest.raises(CheckpointError, match=r"holds no finished checkpoint") as refused:
        evaluate_checkpoint(TrainConfig.from_config_dict(_tiny()), str(tmp_path))
    assert refused.value.exit_status == 4  # as sample.py's for a workdir without a checkpoint


@pytest.mark.parametrize(
    "key, value",
    [("model.d_model", 2**20), ("model.num_layers", 256), ("model.mlp_ratio", 10**6),
     ("batch_size", 10**8), ("pe.train_context", 10**8), ("eval.lengths", (10**8,))],
)  # fmt: skip
def test_sizes_the_devices_cannot_hold_are_refused_before_anything_is_built(
    key, value, tmp_path, monkeypatch
):
    """Each would hang or crash building the data, the state or the program; refused from the
    abstract block and the batch shapes, with no data generated."""
    monkeypatch.setattr(flops, "device_memory", lambda: (2**23, "device memory"))
    monkeypatch.setattr(setup, "build_source", lambda *_: pytest.fail("built the data"))
    with pytest.raises(ConfigError) as refused:
        check_run(TrainConfig.from_config_dict(_tiny(**{key: value})), str(tmp_path), ONE_CPU)
    assert refused.value.exit_status == 2
    shown = {"eval.lengths": f"max(eval.lengths) = {10**8}"}.get(key, f"{key} = {value}")
    assert shown in str(refused.value), str(refused.value)
    assert re.search(r"a device needs [\d.]+ GiB of device memory \(a lower bound\), which holds "
                     r"0\.01 GiB; lower them, or add devices", str(refused.value))  # fmt: skip


def test_every_misspelt_command_line_override_is_named_by_the_config(monkeypatch):
    # The commands' --config (command_line.define_run_flags) takes a key the config lacks, so
    # that the conversion names every such key at once, with the closest one.
    config_path = os.path.join(os.path.dirname(__file__), "helpers", "subprocess_run_config.py")
    argv = ["train.py", f"--config={config_path}", "--config.model.d_modle=64"]
    argv += ["--config.opt.lerning_rate=1e-3"]
    monkeypatch.setattr(sys, "argv", argv)
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config", flag_values, lock_config=False, accept_new_attributes=True
    )
    flag_values(argv)
    assert convert_config(flag_values.config)[1] == [
        "model.d_modle: no such key; did you mean model.d_model?",
        "opt.lerning_rate: no such key; did you mean opt.learning_rate?",
    ]


def test_correct_command_line_override_is_applied(monkeypatch):
    config_path = os.path.join(os.path.dirname(__file__), "helpers", "subprocess_run_config.py")
    argv = [
        "train.py",
        f"--config={config_path}",
        "--config.model.d_model=64",
        "--config.opt.nonfinite=skip",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config", flag_values=flag_values, lock_config=True
    )
    flag_values(argv)
    cfg = TrainConfig.from_config_dict(flag_values.config)
    assert cfg.model.d_model == 64 and cfg.data.head_dim == 32 and cfg.opt.nonfinite == "skip"


def test_absent_wikitext2_is_a_data_error_with_directions(tmp_path, monkeypatch):
    # configs/wikitext_cpu.py reads WikiText-2 through its builder; offline and without files the
    # checks stop before anything is built, with the builder's directions.
    from jrope.data import wikitext

    monkeypatch.setattr(wikitext, "archive_host_reachable", lambda: False)
    config = wikitext_cpu.get_config()
    assert config.data.source == "wikitext2"
    config.data.data_dir = str(tmp_path / "tfds")
    config.data.manual_dir = str(tmp_path / "manual")
    with pytest.raises(DataError) as caught:
        check_run(TrainConfig.from_config_dict(config), str(tmp_path / "run"), EIGHT_CPUS)
    message = str(caught.value)
    assert message.startswith("Found before compiling (docs/runs.md):\n  - ")
    assert "WikiText-2 is not available" in message and "wikitext-2-raw-v1.zip" in message
    assert "python -m jrope.data.wikitext --dataset=wikitext2" in message
    assert not (tmp_path / "run").exists()


def test_every_problem_of_the_config_at_once_then_every_problem_of_the_run(tmp_path):
    # The config is converted whole first: its problems come together, none waits for another.
    config = _tiny(
        batch_size=12,
        **{
            "model.compute_dtype": "float16",
            "opt.schedule": "linear",
            "eval.num_sequences": 0,
            "pe.name": "ropee",
        },
    )
    with pytest.raises(ConfigError) as caught:
        check_run(TrainConfig.from_config_dict(config), str(tmp_path), EIGHT_CPUS)
    problems = caught.value.problems
    assert [problem.split()[0] for problem in problems] == [
        "model.compute_dtype",
        "pe.name:",
        "opt.schedule",
        "eval.num_sequences",
    ]
    config = _tiny(batch_size=12, **{"eval.lengths": (1,)})
    with pytest.raises(ConfigError) as caught:
        check_run(TrainConfig.from_config_dict(config), str(tmp_path), EIGHT_CPUS)
    assert [problem.split()[0] for problem in caught.value.problems] == ["eval.lengths"]


def test_a_workdir_that_cannot_be_written_is_refused_before_step_1(tmp_path, monkeypatch):
    # Root writes through a read-only mode: the check asks the OS, so the OS's answer is set here.
    denied = tmp_path / "read_only"
    denied.mkdir()
    real_access = os.access

    def access(path, mode):
        return path != str(denied) and real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ConfigError, match="is no folder you can write to") as refusal:
        check_run(TrainConfig.from_config_dict(tiny_config_dict()), str(denied / "run"), EIGHT_CPUS)
    assert refusal.value.exit_status == 2
    assert not (denied / "run").exists()
