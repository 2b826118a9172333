"""jrope.command_line: the experiments by name, and the commands that messages give, where they run."""

from helpers.repository import ROOT

from jrope import command_line as commands


def test_an_experiment_s_name_is_its_config_file_and_a_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert commands.config_path("quickstart") == str(ROOT / "configs" / "quickstart.py")
    # A config file's argument follows its name.
    assert commands.config_path("kernel_probe:x") == f"{ROOT / 'configs' / 'kernel_probe.py'}:x"
    for as_it_is in ("configs/quickstart.py", "quickstart.py", "nope", "base/x"):
        assert commands.config_path(as_it_is) == as_it_is
    (tmp_path / "quickstart").write_text("")  # a file of that name here is meant as a path
    assert commands.config_path("quickstart") == "quickstart"
    assert commands.last_overrides(["p", "--config", "synthetic_cpu", "--config.seed=1"]) == [
        "p", "--config", str(ROOT / "configs" / "synthetic_cpu.py"), "--config.seed=1"
    ]  # fmt: skip
    assert "quickstart" in commands.EXPERIMENTS and "base" not in commands.EXPERIMENTS


def test_the_last_of_a_repeated_override_wins_with_one_dash_or_two():
    argv = ["p", "--config=q.py", "-config.eval.lengths=(64,)", "--config.seed=1", "x"]
    assert commands.last_overrides([*argv, "--config.eval.lengths=(8,)"]) == [
        "p", "--config=q.py", "--config.seed=1", "x", "--config.eval.lengths=(8,)"
    ]  # fmt: skip


def test_a_clone_s_root_is_given_its_scripts_and_anywhere_else_the_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert commands.command("eval") == "python eval.py"
    monkeypatch.chdir(tmp_path)
    assert commands.command("train") == "python -m jrope.train"
