"""The evaluation protocol: sequences fixed by eval.seed per data and length (paired comparisons),
the reference's counts in the paper configs, and regression's per-sequence and pooled R^2."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.task_configs import tiny_retrieval_config, tiny_signal_config
from helpers.tiny_config import apply_overrides, tiny_config, tiny_text_config_dict

from jrope import losses
from jrope.data.source import build_source
from jrope.errors import ConfigError
from jrope.train import evaluation, setup
from jrope.train.config import TrainConfig


def _random_text(tmp_path, size=6000):
    """A corpus of random letters: two windows hold the same bytes only if they start alike."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    text = letters[np.random.default_rng(0).integers(0, len(letters), size)].tobytes()
    path = tmp_path / "random.txt"
    path.write_bytes(text)
    return path


def _text_config(tmp_path, **overrides):
    path = _random_text(tmp_path)
    config = tiny_text_config_dict(
        tmp_path, **{"data.path": str(path), "data.eval_path": str(path)}
    )
    return TrainConfig.from_config_dict(apply_overrides(config, overrides))


def _config(kind, tmp_path, **overrides):
    overrides = {"mesh.data": 1, **overrides}
    if kind == "synthetic":
        return tiny_config(**{"eval.lengths": (16, 32), **overrides})
    if kind == "signal":
        return tiny_signal_config(**overrides)
    if kind == "retrieval":
        return tiny_retrieval_config(**overrides)
    return _text_config(tmp_path, **overrides)


def _evaluate_recording(cfg):
    """evaluate_lengths over cfg's source, with a step that records every batch it is given and
    scores the inputs themselves as predictions (a result that depends on the data alone)."""
    run = setup.set_up_run(cfg, devices=jax.devices()[:1])
    source, seen = run.source, []

    def step(params, batch):
        seen.append({name: np.asarray(value) for name, value in batch.items()})
        if source.task == "regression":
            outputs = batch["inputs"]
        else:
            outputs = jax.nn.one_hot(batch["inputs"], source.vocab_size, dtype=jnp.float32)
        return losses.task_sums(outputs, batch, source.task, source.num_classes)

    rows = evaluation.evaluate_lengths(step, None, run, step=0)
    return seen, rows


def _metrics(rows):
    """The rows without the run's method and seed, as text (NaN cells compare equal as text)."""
    return repr([{k: v for k, v in row.items() if k not in ("method", "seed")} for row in rows])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["synthetic", "text", "signal", "retrieval"])
def test_every_run_seed_and_method_is_evaluated_on_the_same_sequences(kind, tmp_path):
    first_seen, first_rows = _evaluate_recording(
        _config(kind, tmp_path, seed=0, **{"pe.name": "jordan_rope"})
    )
    other_seen, other_rows = _evaluate_recording(
        _config(kind, tmp_path, seed=5, **{"pe.name": "rope"})
    )
    assert len(first_seen) == len(other_seen) >= 2
    for first, other in zip(first_seen, other_seen, strict=True):
        for name in first:
            np.testing.assert_array_equal(first[name], other[name])
    assert _metrics(first_rows) == _metrics(other_rows)
    # The sequences are eval.seed's: another evaluation seed draws others.
    reseeded, _ = _evaluate_recording(_config(kind, tmp_path, seed=0, **{"eval.seed": 1}))
    assert not np.array_equal(reseeded[0]["inputs"], first_seen[0]["inputs"])


@pytest.mark.parametrize("kind", ["synthetic", "text", "signal", "retrieval"])
def test_the_training_data_still_follow_the_run_seed(kind, tmp_path):
    batches = [
        build_source(_config(kind, tmp_path, seed=seed).data, 8, 0, 1).train_batch(0)["inputs"]
        for seed in (0, 5)
    ]
    assert not np.array_equal(*batches)


def test_windows_of_each_length_are_drawn_independently(tmp_path):
    # As the reference's: every length draws its own start positions, so a longer window is
    # not a shorter one extended.
    cfg = _text_config(tmp_path)
    source = build_source(cfg.data, cfg.batch_size, 0, 1)
    short = next(source.eval_batches(16, 8, 8))["inputs"]
    long = next(source.eval_batches(32, 8, 8))["inputs"]
    assert not any(np.array_equal(long[i, :16], short[i]) for i in range(8))
    # Sequence i of a length does not depend on how many are asked for.
    np.testing.assert_array_equal(next(source.eval_batches(16, 2, 2))["inputs"], short[:2])


def test_regression_reports_the_mean_of_per_sequence_r2_and_the_pooled_r2_beside_it():
    cfg = tiny_signal_config()
    batch = next(build_source(cfg.data, 8, 0, 1).eval_batches(32, 4, 4))
    targets = batch["targets"].astype(np.float64)
    # A model good on some sequences and poor on others; the targets' scales differ too.
    scales = np.array([0.5, 1.0, 2.0, 4.0])[:, None, None]
    targets = targets * scales
    rng = np.random.default_rng(3)
    noise = rng.standard_normal(targets.shape) * np.array([0.05, 0.5, 0.2, 3.0])[:, None, None]
    predictions = targets + noise
    weights = np.ones(targets.shape[:2])
    sums = losses.squared_error_sums(
        jnp.asarray(predictions, jnp.float32),
        jnp.asarray(targets, jnp.float32),
        jnp.asarray(weights, jnp.float32),
    )
    metrics = losses.metrics_from_sums(jax.device_get(sums), "regression")
    # Each sequence's own R^2 (over its positions and channels), then their mean.
    errors = np.mean((predictions - targets) ** 2, axis=(1, 2))
    per_sequence = 1 - errors / np.var(targets, axis=(1, 2))
    pooled = 1 - np.mean(noise**2) / np.var(targets)
    assert float(metrics["r2"]) == pytest.approx(per_sequence.mean(), rel=1e-4)
    assert float(metrics["r2_pooled"]) == pytest.approx(pooled, rel=1e-4)
    assert abs(float(metrics["r2"]) - float(metrics["r2_pooled"])) > 0.1
    # A sequence of zero weight is not one of the sequences averaged.
    weights[3] = 0.0
    sums = losses.squared_error_sums(
        jnp.asarray(predictions, jnp.float32),
        jnp.asarray(targets, jnp.float32),
        jnp.asarray(weights, jnp.float32),
    )
    metrics = losses.metrics_from_sums(jax.device_get(sums), "regression")
    assert float(metrics["r2"]) == pytest.approx(per_sequence[:3].mean(), rel=1e-4)


def test_results_files_carry_both_r2_and_read_back(tmp_path):
    nan = float("nan")
    rows = [
        _result_row(length, 4) | dict(accuracy=nan, r2=r2, r2_pooled=pooled)
        for length, r2, pooled in ((16, 0.61, 0.83), (32, 0.25, 0.47))
    ]
    evaluation.write_results(rows, tmp_path, task="regression")
    table = (tmp_path / "eval.md").read_text()
    assert "| length | loss | r2 | r2_pooled |" in table
    assert "r2_pooled" in (tmp_path / "eval.csv").read_text().splitlines()[0]
    back = evaluation.read_results(tmp_path)
    assert [(row["r2"], row["r2_pooled"]) for row in back] == [(0.61, 0.83), (0.25, 0.47)]
    # A results CSV without the r2_pooled column holds the pooled R^2 under r2.
    lines = (tmp_path / "eval.csv").read_text().splitlines()
    header = lines[0].split(",")
    drop = header.index("r2_pooled")
    (tmp_path / "eval.csv").write_text(
        "\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != drop) for line in lines)
    )
    old = evaluation.read_results(tmp_path)
    assert [row["r2_pooled"] for row in old] == [0.61, 0.25]
    assert all(np.isnan(row["r2"]) for row in old)


@pytest.mark.parametrize(
    "name, count",
    [
        ("wikitext_scaled_exact", 16),  # the reference's configs/lm_focused.yaml
        ("wikitext_eta", 16),
        ("wikitext_v2", 2),  # its configs/high_jet_wikitext103_subset_500_seeds012.yaml
        ("synthetic", 32),  # configs/kernel_lm.yaml
        ("signal_regression", 4),  # configs/signal_benchmarks.yaml
        ("retrieval", 256),  # configs/full_research.yaml, retrieval
        ("audio_lm_musicnet", 64),  # configs/audio_lm_medium_musicnet.yaml
        ("wikitext_boundary", 4),  # configs/phase2_wikitext103_subset_boundary_500.yaml
        ("synthetic_eta_scan", 8),  # configs/phase2_kernel_lm_stage3_bounded_eta_scan.yaml
    ],
)
def test_paper_configs_evaluate_on_the_reference_counts_of_fixed_sequences(name, count):
    config = importlib.import_module(f"configs.{name}").get_config()
    assert config.eval.num_sequences == count
    assert config.eval.num_sequences % config.eval.batch_size == 0
    assert "seed" in config.eval and config.eval.seed == 0


def test_eval_seed_out_of_range_is_refused():
    with pytest.raises(
        ConfigError, match=r"eval\.seed must be an integer in \[0, 4294967295\], got -1"
    ):
        tiny_config(**{"eval.seed": -1})


def test_a_long_length_reports_its_progress_with_the_time_left(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evaluation, "PROGRESS_INTERVAL_S", 0.0)  # every batch counts as long
    cfg = _config("synthetic", tmp_path, **{"eval.num_sequences": 12, "eval.batch_size": 4})
    _evaluate_recording(cfg)
    progress = [line for line in capsys.readouterr().out.splitlines() if "sequences in" in line]
    # The pace is measured from the first batch on: a line after 8 of 12 sequences per length,
    # none once a length is done.
    assert [line.split(":")[0].strip() for line in progress] == ["length 16", "length 32"]
    assert [line.split(": ")[1].split(" sequences")[0] for line in progress] == ["8 of 12"] * 2
    assert all(line.endswith(" left") and "about " in line for line in progress)


def _result_row(length, num_sequences, distance=None):
    nan = float("nan")
    return dict(
        method="rope",
        seed=0,
        step=4,
        length=length,
        distance=distance,
        num_sequences=num_sequences,
        loss=0.5,
        accuracy=0.25,
        bits_per_byte=nan,
        r2=nan,
        r2_pooled=nan,
    )


def test_a_length_evaluated_again_is_said_with_the_compute_dtypes_that_differ(tmp_path, capsys):
    evaluated = [_result_row(length, 4) | {"compute_dtype": "float32"} for length in (16, 32)]
    evaluation.write_results(evaluated, tmp_path, task="classification")
    earlier = evaluation.read_results(tmp_path)
    assert [row["compute_dtype"] for row in earlier] == ["float32", "float32"]
    again = [_result_row(length, 4) | {"compute_dtype": "bfloat16"} for length in (32, 64)]
    evaluation.merge_rows(earlier, again)
    said = "  length 32: row replaced (float32 there, bfloat16 now)\n"
    assert capsys.readouterr().out == said
    # A CSV written before the columns: read without a dtype, its row replaced all the same.
    lines = (tmp_path / "eval.csv").read_text().splitlines()
    (tmp_path / "eval.csv").write_text("\n".join(line.rsplit(",", 2)[0] for line in lines))
    earlier = evaluation.read_results(tmp_path)
    assert [row["compute_dtype"] for row in earlier] == [None, None]
    evaluation.merge_rows(earlier, again)
    assert capsys.readouterr().out == "  length 32: row replaced\n"


def _table_cells(table: str, header_start: str) -> list[list[str]]:
    """The cells of the markdown table whose header starts with `header_start` (header first)."""
    lines = table.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [lines[first]] + lines[first + 2 : end]  # without the |---| line
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_written_table_gives_each_row_its_own_sequence_count_after_a_merge(tmp_path, capsys):
    one_count = [_result_row(16, 4), _result_row(32, 4)]
    evaluation.write_results(one_count, tmp_path / "one", task="classification")
    table = (tmp_path / "one" / "eval.md").read_text()
    assert table.startswith("method: rope, seed: 0, step: 4, 4 sequences per length\n")
    assert "num_sequences" not in table
    # A second evaluation with 8 sequences replaces length 32 and adds 64 and a distance row.
    merged = evaluation.merge_rows(
        one_count, [_result_row(32, 8), _result_row(64, 8), _result_row(64, 8, distance=10)]
    )
    out_dir = tmp_path / "merged"
    evaluation.write_results(merged, out_dir, task="classification")
    table = (out_dir / "eval.md").read_text()
    assert "sequences per length" not in table
    cells = _table_cells(table, "| length | accuracy")
    assert cells[0] == ["length", "accuracy", "loss", "num_sequences"]
    assert [(row[0], row[-1]) for row in cells[1:]] == [
        ("16", "4"),
        ("32", "8"),
        ("64", "8"),
        ("mean", ""),
    ]
    at_distance = _table_cells(table, "| length | distance")
    assert at_distance == [
        ["length", "distance", "accuracy", "loss", "num_sequences"],
        ["64", "10", "0.2500", "0.5000", "8"],
    ]
    # The console shows the table as written.
    evaluation.show_results(merged, out_dir, task="classification")
    assert table in capsys.readouterr().out
