"""The entry points as a user runs them: bad input ends in a short message with the key and the fix.

Every command runs as a subprocess from the repository root (tests/helpers/train_process.py);
they run a few at a time, and each case checks its own: a non-zero exit status of the kind
documented in the README (jrope.command_line), no traceback, at most 25 lines, and the words that
name the key or file and the fix. There is a case per way a command can stop before it starts
(the flag parser, the config's checks, the workdir, the data, eval.py, a probe, a comparison); the
message of every config and data problem is checked in-process (test_checks.py, test_config.py,
test_text_bytes.py). A short run's whole console fits on a screen and shows its results.
"""

import concurrent.futures
import re

import pytest
from helpers.train_process import RUN_CONFIG, free_port, run_command, subprocess_env

TINY = f"--config={RUN_CONFIG}"
WIKITEXT_CPU = "--config=configs/wikitext_cpu.py"


def _text_data(tmp, train="train.txt", evaluation="short.txt"):
    return [
        WIKITEXT_CPU,
        "--config.data.source=text",
        f"--config.data.path={tmp}/{train}",
        f"--config.data.eval_path={tmp}/{evaluation}",
        f"--config.data.cache_dir={tmp}/cache",
    ]


BEYOND_INT32 = (
    "model.d_model",
    "pe.train_context",
    "batch_size",
    "model.mlp_ratio",
    "num_steps",
)
# (id, arguments after `python` (format fields: {tmp}), exit status, patterns all to be found)
BAD_INPUTS = [
    (
        "misspelt_keys",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.pe.nmae=rope", "--config.num_step=3"],
        2,
        [
            r"^Found before compiling \(docs/runs\.md\):\n"
            r"  - num_step: no such key; did you mean num_steps\?\n"
            r"  - pe\.nmae: no such key; did you mean pe\.name\?\n$",
        ],
    ),
    (
        "word_for_a_number",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.num_steps=abc"],
        2,
        [r"^flag --config\.num_steps=abc: invalid literal for int\(\).*; see --help\.\n$"],
    ),
    (
        "zero_heads",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.model.num_heads=0"],
        2,
        [
            r"^Found before compiling",
            r"model\.num_heads must be an integer in \[1, 2147483647\], got 0",
        ],
    ),
    (
        "sizes_beyond_int32",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.opt.warmup_steps=3000000000"]
        + [f"--config.{key}=1000000000000" for key in BEYOND_INT32]
        + ["--config.model.num_layers=1000000000000"],
        2,
        [r"opt\.warmup_steps must be an integer in \[0, 2147483647\], got 3000000000\."]
        + [r"model\.num_layers must be an integer in \[1, 256\], got 10{12}\."]
        + [
            rf"\n  - {key} must be an integer in \[1, 2147483647\], got 10{{12}}\."
            for key in BEYOND_INT32
        ],
    ),
    (
        "a_length_twice",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.eval.lengths=(64,64)"],
        2,
        [
            r"eval\.lengths must be a non-empty tuple of distinct integers in \[2, 2147483647\], got \(64, 64\)"
        ],
    ),
    (
        "misspelt_section",
        ["train.py", TINY, "--workdir={tmp}/run", "--config.trian.num_steps=10"],
        2,
        [
            r"^--config\.trian\.num_steps: the config has no section 'trian'; did you mean --config\.num_steps\?\n$"
        ],
    ),
    (
        "misspelt_accepted_change",
        [
            "train.py",
            TINY,
            "--workdir={tmp}/run",
            "--config.checkpoint.accept_changes=opt.learning_rat",
        ],
        2,
        [
            r"checkpoint\.accept_changes names 'opt\.learning_rat': no such key; did you mean opt\.learning_rate\?"
        ],
    ),
    (
        "no_config_file",
        ["train.py", "--config=configs/nope.py", "--workdir={tmp}/run"],
        2,
        [r"^--config=configs/nope\.py is no config file here, nor one of .*quickstart"],
    ),
    (
        "no_experiment_of_that_name",
        ["train.py", "--config=quickstrat", "--workdir={tmp}/run"],
        2,
        [r"^--config=quickstrat is no config file here, nor one of .*quickstart, retrieval"],
    ),
    (
        "the_last_of_two_configs_is_no_experiment",
        ["train.py", TINY, "--config=quickstrat", "--workdir={tmp}/run"],
        2,
        [r"^--config=quickstrat is no config file here, nor one of .*quickstart, retrieval"],
    ),
    (
        "config_is_a_folder",
        ["train.py", "--config=configs", "--workdir={tmp}/run"],
        2,
        [r"^--config=configs is no config file here"],
    ),
    (
        "config_file_with_a_syntax_error",
        ["train.py", "--config={tmp}/broken.py", "--workdir={tmp}/run"],
        2,
        [r"broken\.py, line 2\)"],
    ),
    (
        "config_file_that_raises",
        ["train.py", "--config={tmp}/raises.py", "--workdir={tmp}/run"],
        2,
        [r"raises\.py, line 3: KeyError: 'foo'\.$"],
    ),
    (
        "a_process_id_outside_the_processes",
        ["train.py", TINY, "--workdir={tmp}/run", "--num_processes=2", "--process_id=2"],
        2,
        [r"--process_id must be below --num_processes; see --help\."],
    ),
    (
        "no_workdir",
        ["train.py", TINY],
        2,
        [r"Flag --workdir must have a value other than None"],
    ),
    (
        "workdir_is_a_file",
        ["train.py", TINY, "--workdir={tmp}/train.txt"],
        2,
        [r"--workdir .*/train\.txt: .*train\.txt is no folder you can write to\."],
    ),
    (
        "text_file_missing",
        ["train.py", *_text_data("{tmp}", train="absent.txt"), "--workdir={tmp}/run"],
        3,
        [r"data\.path = '.*/absent\.txt' does not exist; point --config\.data\.path at"],
    ),
    (
        "evaluate_an_untrained_workdir",
        ["eval.py", TINY, "--workdir={tmp}"],
        4,
        [r"holds no finished checkpoint; point it at a trained run\.$"],
    ),
    (
        "probe_with_unknown_method",
        ["eval.py", "--config=configs/kernel_probe.py", "--workdir={tmp}/probe"]
        + ["--config.probe.methods=('rope','jordan_bogus')"],
        2,
        [r"unknown position-encoding name 'jordan_bogus'"],
    ),
    (
        "compare_misspelt_method_last",
        ["-m", "jrope.compare", TINY, "--workdir={tmp}/compare", "--methods=rope,jordan_ropee"]
        + ["--seeds=0,1"],
        2,
        [
            r"^Found before compiling \(docs/runs\.md\):\n  - jordan_ropee seeds 0, 1: pe\.name: "
            r"unknown position-encoding name 'jordan_ropee'; did you mean jordan_rope\?"
        ],
    ),
    (
        "compare_without_methods",
        ["-m", "jrope.compare", TINY, "--workdir={tmp}/compare"],
        2,
        [r"^--methods is empty: use --methods=rope,jordan_rope\.\n$"],
    ),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every case of BAD_INPUTS run once, three at a time: id -> (CompletedProcess, its tmp dir)."""
    env = subprocess_env(1)
    folders = {case[0]: tmp_path_factory.mktemp(case[0]) for case in BAD_INPUTS}  # not in threads

    def run(case):
        name, args = case[0], case[1]
        tmp = folders[name]
        (tmp / "train.txt").write_text("A line of training text.\n" * 200)
        (tmp / "short.txt").write_text("x" * 299 + "\n")
        (tmp / "broken.py").write_text("def get_config():\n    return {\n")
        (tmp / "raises.py").write_text(
            "def get_config():\n    settings = {}\n    return settings['foo']\n"
        )
        return name, (run_command([arg.format(tmp=tmp) for arg in args], env), tmp)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, BAD_INPUTS))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, status, patterns",
    [(c[0], c[2], c[3]) for c in BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS],
)
def test_bad_input_ends_in_a_short_message_naming_key_and_fix(
    bad_input_runs, name, status, patterns
):
    result, tmp = bad_input_runs[name]
    console = result.stdout + result.stderr
    assert result.returncode == status, console
    assert "Traceback" not in console
    assert len(console.splitlines()) <= 25, console
    for pattern in patterns:
        assert re.search(pattern, result.stderr), result.stderr
    # Refused before anything was written: no workdir, no checkpoint, no comparison.
    for output in ("run", "compare", "probe"):
        assert not (tmp / output).exists()


@pytest.mark.slow
def test_verbose_shows_the_traceback_too(tmp_path):
    args = ["train.py", TINY, f"--workdir={tmp_path}/run", "--config.pe.name=jordan_bogus"]
    env = subprocess_env(1)
    verbose = run_command([*args, "--verbose"], env)
    assert verbose.returncode == 2
    assert (
        "Traceback" in verbose.stderr
        and "unknown position-encoding name 'jordan_bogus'" in verbose.stderr
    )


@pytest.mark.slow
def test_a_short_run_shows_progress_and_results_on_one_screen(tmp_path):
    workdir = tmp_path / "run"
    args = ["train.py", TINY, f"--workdir={workdir}", "--config.num_steps=16"]
    result = run_command([*args, "--config.log.every_steps=4"], subprocess_env(1))
    console = result.stdout + result.stderr
    assert result.returncode == 0, console
    lines = console.splitlines()
    assert len(lines) < 40, console
    assert not [line for line in lines if re.match(r"^[IW]\d{4} ", line)]  # no library log records
    assert re.search(r"^Compiling the train step \.\.\. done in [\d.]+ s\.$", console, re.M)
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["4/16", "8/16", "12/16", "16/16"]
    assert all(re.search(r" steps/s  [\d.]+k? tokens/s", line) for line in progress)
    assert all(" left" in line for line in progress[:-1])
    assert re.search(r"^  length 8: accuracy [\d.]+  loss [\d.]+  \([\d.]+ s\)$", console, re.M)
    # The evaluation table as written to eval.md, and where it is.
    table = (workdir / "eval_step16" / "eval.md").read_text()
    assert table.startswith("method: rope, seed: 0, step: 16, 8 sequences per length")
    assert f"{workdir / 'eval_step16' / 'eval.md'}:\n\n{table}" in result.stdout
    # No checkpoint nobody asked for (every 8 steps, and the last).
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["16", "8"]


# (entry point after `python`, flags its --help must list: its own and those of the modules it uses)
HELP_CASES = [
    (["train.py"], ["--config", "--workdir", "--coordinator_address", "--verbose"]),
    (["eval.py"], ["--config", "--workdir", "--num_processes", "--verbose"]),
    (["sample.py"], ["--workdir", "--prompt", "--num_tokens", "--top_p", "--verbose"]),
    (["-m", "jrope.compare"], ["--methods", "--seeds", "--workdir", "--multiprocess"]),
    (["-m", "jrope.data.wikitext"], ["--dataset", "--data_dir", "--manual_dir"]),
    (["-m", "jrope.data.audio"], ["--archive", "--wav_dir", "--out_dir", "--max_files"]),
]


@pytest.mark.slow
def test_help_of_every_entry_point_lists_its_flags_and_exits_0(tmp_path):
    env = subprocess_env(1)

    def run(case):
        command, _ = case
        return run_command([*command, "--help"], env)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, HELP_CASES))
    for (command, expected), short in zip(HELP_CASES, results, strict=True):
        assert short.returncode == 0, (command, short.stdout + short.stderr)
        for flag in expected:
            assert re.search(rf"^  {flag}[:=]|^  --\[no\]{flag[2:]}:", short.stdout, re.M), (
                command,
                flag,
                short.stdout,
            )
        # The libraries' flags (absl's logging here): --helpfull only.
        assert "--[no]logtostderr" not in short.stdout, command
    full = run_command(["train.py", "--helpfull"], env)  # absl's own, the same for every command
    assert full.returncode == 0 and "--[no]logtostderr" in full.stdout
    # A clone's scripts print the package command's usage.
    assert results[0].stdout.startswith("Train one model: python -m jrope.train")
    sample_help = results[2].stdout
    # The usage example keeps its line break and continuation, as a shell takes it.
    assert "jordan_exact_scaled/seed0 \\\n        --prompt=" in sample_help


@pytest.mark.slow
def test_a_multi_process_run_reports_from_process_0(tmp_path):
    env = subprocess_env(2)
    port = free_port()
    args = [
        "train.py",
        TINY,
        f"--workdir={tmp_path}/run",
        "--config.num_steps=4",
        "--config.log.every_steps=2",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(lambda index: run_command([*args, f"--process_id={index}"], env), (0, 1))
        )
    assert [result.returncode for result in results] == [0, 0], results[0].stderr
    first, second = results
    assert "step 4/4" in first.stdout and "eval_step4/eval.md" in first.stdout
    # Process 1 shows nothing of its own. (Gloo, JAX's CPU collectives, prints its connections
    # from several threads at once: their lines may interleave, so they are not matched.)
    own = ("Training ", "Compiling", "step ", "eval_step", "|")
    assert [line for line in second.stdout.splitlines() if line.startswith(own)] == []
