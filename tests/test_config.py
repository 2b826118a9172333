"""The run config (jrope.train.config): the sections, the one parser, and config files from anywhere."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers.repository import ROOT
from helpers.tiny_config import tiny_config, tiny_config_dict, tiny_text_config_dict

from jrope import saved_run_config
from jrope.errors import ConfigError
from jrope.pe_config import pe_config_from_name
from jrope.train.config import (
    PE_KEYS,
    EvalConfig,
    RuntimeConfig,
    TrainConfig,
    convert_config,
    keys_without_effect,
    load_config_file,
)


def test_the_pe_section_is_the_library_pe_config_parsed_from_the_name():
    cfg = tiny_config(**{"pe.name": "jordan_exact_c150_eta010"})
    assert cfg.pe == pe_config_from_name(
        "jordan_exact_c150_eta010",
        train_context=16,
        theta=10000.0,
        gamma_min=1e-4,
        init_gamma=1e-4,
        eta_max=0.1,
        init_eta=0.0,
    )
    assert (cfg.pe.gamma_min, cfg.pe.init_gamma, cfg.pe.init_eta) == (0.0, 1.5 / 16, 0.01)
    # The section's keys are pe_config_from_name's arguments: PEConfig declares their rules.
    assert list(PE_KEYS) == [
        "name", "train_context", "theta", "gamma_min", "init_gamma", "eta_max", "init_eta"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["rope", "jordan_rope", "jordan_exact_c010_eta100_eta1"])
def test_the_json_form_converts_back_to_the_same_config(name):
    cfg = tiny_config(**{"pe.name": name})
    again = TrainConfig.from_config_dict(cfg.to_json_dict())
    assert again == cfg and again.to_json_dict() == cfg.to_json_dict()


def test_every_problem_of_every_section_is_reported_at_once_with_its_key():
    config = tiny_config_dict(
        **{
            "model.compute_dtype": "float16",
            "model.dropout": 0.1,
            "opt.schedule": "linear",
            "eval.num_sequences": 0,
            "checkpoint.every_steps": 0,
            "pe.name": "jordan_rop",
            "runtime.profile_to_step": -1,
        }
    )
    config.zzz = 1
    config.num_step = 3
    cfg, problems = convert_config(config)
    assert [problem.split()[0] for problem in problems] == [
        "num_step:",
        "zzz:",
        "model.dropout:",
        "model.compute_dtype",
        "pe.name:",
        "opt.schedule",
        "checkpoint.every_steps",
        "eval.num_sequences",
        "runtime.profile_to_step",
    ]
    assert "zzz: no such key; drop it." in problems
    assert "num_step: no such key; did you mean num_steps?" in problems
    assert "model.dropout: no such key; did you mean model.dropout_rate?" in problems
    assert (
        "did you mean jordan_rope?" in problems[4]
        and problems[4].count("unknown position-encoding name") == 1
    )
    assert cfg is None  # a config is converted whole or not at all
    with pytest.raises(ConfigError, match=r"(?s)^Found before compiling.*\n  - zzz: no such"):
        TrainConfig.from_config_dict(config)


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("opt.b1", 1.5, "opt.b1 must be a finite number in [0, 1), got 1.5."),
        ("opt.b2", 2.0, "opt.b2 must be a finite number in [0, 1), got 2.0."),
        ("opt.eps", -1.0, "opt.eps must be a finite number > 0, got -1.0."),
        ("opt.weight_decay", -0.5, "opt.weight_decay must be a finite number >= 0, got -0.5."),
        (
            "opt.final_lr_ratio",
            -3.0,
            "opt.final_lr_ratio must be a finite number in [0, 1], got -3.0.",
        ),
        ("pe.eta_max", float("nan"), "pe.eta_max must be a finite number > 0.0, got nan."),
        ("pe.theta", float("inf"), "pe.theta must be a finite number > 1.0, got inf."),
    ],
)
def test_optimizer_settings_and_non_finite_numbers_are_refused_by_name(key, value, problem):
    _, problems = convert_config(tiny_config_dict(**{key: value}))
    assert problems == [problem]


def test_a_head_dim_the_encoding_cannot_take_blames_the_model_keys():
    _, problems = convert_config(tiny_config_dict(**{"model.d_model": 30}))  # 2 heads of 15
    assert len(problems) == 1 and problems[0].startswith(
        "model.d_model = 30: jordan_rope needs d_model / num_heads (15)"
    )
    assert "data." not in problems[0]


def test_values_of_the_wrong_type_are_named_not_crashed_on():
    config = tiny_config_dict().to_dict()
    config["pe"]["theta"] = "10000"
    config["num_steps"] = "2"
    config["eval"]["lengths"] = [16, 32]  # a list is a tuple
    _, problems = convert_config(config)
    assert problems == [
        "num_steps must be an integer in [1, 2147483647], got '2'.",
        "pe.theta must be a finite number > 1.0, got '10000'.",
    ]


def test_a_missing_key_is_named_and_a_missing_section_takes_its_defaults():
    config = tiny_config_dict().to_dict()
    del config["runtime"]
    del config["opt"]["learning_rate"]
    cfg, problems = convert_config(config)
    assert cfg is None and problems == ["opt.learning_rate is missing; set it in the config file."]
    config["opt"]["learning_rate"] = 1e-3
    assert convert_config(config)[0].runtime == RuntimeConfig()


def test_sections_check_themselves_when_built_directly():
    with pytest.raises(
        ValueError, match=r"eval\.batch_size must divide num_sequences = 4, got 3\."
    ):
        EvalConfig(lengths=(16,), num_sequences=4, batch_size=3, every_steps=0)
    model = tiny_config().model  # the model's own config, usable without the harness
    with pytest.raises(ValueError, match=r"model\.num_heads must divide d_model = 32, got 3\."):
        dataclasses.replace(model, num_heads=3)


@pytest.mark.slow
def test_config_files_load_from_any_working_directory(tmp_path):
    # configs/*.py import `configs.base`: the loader, not the working directory, makes it importable.
    path = os.path.join(ROOT, "configs", "quickstart.py")
    assert load_config_file(path).pe.name == "jordan_rope"
    script = (
        "from jrope.train.config import load_config_file; "
        f"print(load_config_file({path!r}).num_steps)"
    )
    env = {**os.environ, "PYTHONPATH": ""}  # jrope from its install, configs from nowhere
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["250"]


def test_a_data_key_the_chosen_source_never_reads_is_refused_with_the_fix(tmp_path):
    config = tiny_text_config_dict(tmp_path, **{"data.manual_dir": str(tmp_path)})
    _, problems = convert_config(config)
    assert problems == [
        f"data.manual_dir = {str(tmp_path)!r} has no effect with data.source = 'text'; drop it, "
        "or set data.source to one of ('wikitext103', 'wikitext2')."
    ]
    config = tiny_text_config_dict(tmp_path, **{"data.source": "wikitext2"})
    _, problems = convert_config(config)
    assert [p.split(";")[0] for p in problems] == [
        f"data.path = {config.data.path!r} has no effect with data.source = 'wikitext2'",
        f"data.eval_path = {config.data.eval_path!r} has no effect with data.source = 'wikitext2'",
    ]
    assert all(
        p.endswith("or set data.source to one of ('text', 'audio_tokens').") for p in problems
    )


def test_a_kernel_setting_the_chosen_kernel_ignores_is_named_in_a_warning(caplog):
    config = tiny_config_dict(**{"data.jet_power": 5})
    with caplog.at_level("WARNING"):
        _, problems = convert_config(config)
    assert problems == []  # configs/synthetic.py carries every kernel's settings
    assert "data.jet_power = 5 has no effect with data.kernel = 'mixed_raw'" in caplog.text
    caplog.clear()
    config = tiny_config_dict(**{"data.jet_power": 5, "data.kernel": "high_jet"})
    with caplog.at_level("WARNING"):
        _, problems = convert_config(config)
    assert problems == [] and "jet_power" not in caplog.text


def test_no_shipped_config_sets_a_key_without_effect():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name == "base.py" or not name.endswith(".py"):  # base: sections, not an experiment
            continue
        config = load_config_file(os.path.join(ROOT, "configs", name))
        if "probe" in config:
            continue
        cfg, problems = convert_config(config)
        assert problems == [] and keys_without_effect(cfg.data) == ([], []), name


def test_a_saved_config_holding_a_retired_key_still_loads(tmp_path):
    saved = tiny_config().to_json_dict()
    saved["eval"]["max_hours"] = 24.0  # written by checkpoints of earlier versions
    saved["data"].update(seq_len=16, head_dim=8, theta=10000.0)  # and these, once config keys
    with pytest.raises(ConfigError, match=r"eval\.max_hours: no such key"):
        TrainConfig.from_config_dict(saved)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "metadata").write_text(json.dumps(saved))
    kept = saved_run_config.read_saved_config(tmp_path)
    assert TrainConfig.from_config_dict(kept) == tiny_config()


def test_the_data_keys_that_are_the_models_are_set_from_it_and_refused_in_a_config():
    cfg = tiny_config(**{"pe.train_context": 24, "model.d_model": 48, "pe.theta": 500.0})
    assert (cfg.data.seq_len, cfg.data.head_dim, cfg.data.theta) == (24, 48 // 2, 500.0)
    assert "seq_len" not in cfg.to_json_dict()["data"]
    config = tiny_config_dict()
    config.data.seq_len = 24
    _, problems = convert_config(config)
    assert problems == ["data.seq_len: set from pe.train_context; set pe.train_context instead."]
    config = tiny_config_dict()
    config.data.pack = True  # the synthetic task has no such key
    assert convert_config(config)[1] == ["data.pack: no such key; drop it."]


def test_sizes_and_steps_stay_within_int32_and_a_length_comes_once_each_named():
    big = 10**12
    sizes = {"model.d_model": big, "pe.train_context": big, "batch_size": big, "num_steps": big}
    sizes.update({"model.mlp_ratio": big, "opt.warmup_steps": 3 * 10**9})
    _, problems = convert_config(tiny_config_dict(**sizes, **{"eval.lengths": (64, 64)}))
    assert sorted(problem.split()[0] for problem in problems) == sorted([*sizes, "eval.lengths"])
    assert all("2147483647]" in problem for problem in problems)
    assert problems[-1].endswith("distinct integers in [2, 2147483647], got (64, 64).")
    # Deeper than the unrolled blocks can be traced in minutes: refused before any work.
    _, problems = convert_config(tiny_config_dict(**{"model.num_layers": 10**5}))
    assert problems == ["model.num_layers must be an integer in [1, 256], got 100000."]


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"model.d_model": -1}, "model.d_model must be an integer in [1, 2147483647], got -1."),
        ({"eval.num_sequences": -1}, "eval.num_sequences must be an integer in [1, 2147483647]"),
        ({"seed": 2**40}, "seed must be an integer in [0, 4294967295], got 1099511627776."),
    ],
)
def test_one_fault_is_one_line_naming_its_key(overrides, problem):
    _, problems = convert_config(tiny_config_dict(**overrides))
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_a_misspelt_accepted_change_is_named_as_matching_no_key():
    accepted = "opt.learning_rat, model"
    _, problems = convert_config(tiny_config_dict(**{"checkpoint.accept_changes": accepted}))
    assert problems == [
        "checkpoint.accept_changes names 'opt.learning_rat': no such key; "
        "did you mean opt.learning_rate?"
    ]
