"""jrope.train.outputs: the metrics log and its checks, TensorBoard, throughput, MFU and model FLOPs."""

import dataclasses
import json
import math
import os
import re

import numpy as np
import pytest
from flax import nnx
from helpers.tiny_config import tiny_config

from jrope.flops import Throughput, model_flops_per_step, peak_flops_per_sec
from jrope.model import Transformer
from jrope.train import outputs
from jrope.train.outputs import MetricsLogger
from jrope.train.setup import run_encoding


@dataclasses.dataclass
class FakeDevice:
    device_kind: str


def test_peak_of_known_devices_and_none_for_the_rest():
    assert peak_flops_per_sec([FakeDevice("TPU v4")] * 8, "bfloat16") == 8 * 275e12
    # float32 at XLA's default precision: TF32 tensor cores on an A100.
    assert peak_flops_per_sec([FakeDevice("NVIDIA A100-SXM4-80GB")], "float32") == 156e12
    assert peak_flops_per_sec([FakeDevice("Tesla V100-SXM2-16GB")], "bfloat16") is None
    assert peak_flops_per_sec([FakeDevice("cpu")], "float32") is None


def test_tokens_per_second_and_mfu_from_the_step_rate():
    cfg = tiny_config()  # batch 8 x L 16
    tpus = [FakeDevice("TPU v5 lite")] * 2
    rates = Throughput.for_model(cfg.model, 8, 16, tpus, vocab_size=3).rates(10.0)
    assert rates["tokens_per_sec"] == 10.0 * 8 * 16
    flops = model_flops_per_step(cfg.model, cfg.batch_size, cfg.pe.train_context, 3)["total"]
    assert rates["mfu"] == pytest.approx(10.0 * flops / (2 * 197e12))
    cpu = Throughput.for_model(cfg.model, 8, 16, [FakeDevice("cpu")], vocab_size=3)
    assert "mfu" not in cpu.rates(10.0)


def test_durations_are_shown_in_seconds_minutes_or_hours():
    assert outputs.duration(4.21) == "4.2 s"
    assert outputs.duration(185.4) == "3 min 05 s"
    assert outputs.duration(3599.7) == "1 h 00 min"  # rounded to the second first
    assert outputs.duration(2 * 3600 + 7 * 60 + 20) == "2 h 07 min"


def _metrics(loss):
    return {"loss": np.float32(loss), "accuracy": np.float32(0.5), "grad_norm": np.float32(1.0)}


class _StopAfterFirstWrite:
    """A stdout at which a stop (SIGTERM's handler raising) arrives as its first write returns."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text
        if len(self.text) == len(text):
            raise KeyboardInterrupt

    def flush(self):
        pass


def test_a_stop_while_a_line_is_shown_leaves_the_line_whole(monkeypatch):
    """The stop message follows on a line of its own, not on the end of the interrupted one."""
    stdout = _StopAfterFirstWrite()
    monkeypatch.setattr("sys.stdout", stdout)
    with pytest.raises(KeyboardInterrupt):
        outputs.say("  length 8: accuracy 0.3750  loss 4.4082  (1.6 s)")
    assert stdout.text == "  length 8: accuracy 0.3750  loss 4.4082  (1.6 s)\n"


def test_progress_line_shows_step_loss_rates_and_time_left(tmp_path, capsys):
    known = Throughput(tokens_per_step=1000, model_flops_per_step=1e12, peak_flops_per_sec=1e14)
    logger = MetricsLogger(
        str(tmp_path),
        every_steps=2,
        num_steps=4,
        tensorboard=False,
        throughput=known,
    )
    for step in range(1, 5):
        logger.write_step(step, {k: float(v) for k, v in _metrics(1.0 / step).items()})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    pattern = (
        r"step 2/4  loss 0\.5  accuracy 0\.5  ([\d.e+]+) steps/s  ([\d.]+[kMG]?) tokens/s  "
        r"MFU ([\d.]+) %  [\d.]+ (s|min \d+ s) left"
    )
    assert re.fullmatch(pattern, lines[0]), lines[0]
    assert lines[1].startswith("step 4/4  loss 0.25") and "left" not in lines[1]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert records[0]["train/tokens_per_sec"] == pytest.approx(
        1000 * records[0]["train/steps_per_sec"]
    )
    assert records[0]["train/mfu"] == pytest.approx(records[0]["train/steps_per_sec"] / 100)


def _start(workdir, *, start_step, num_steps, redo_step=None):
    """A logger of a run (re)starting at `start_step`, closed at once: what it left in the log."""
    MetricsLogger(
        str(workdir),
        every_steps=1,
        num_steps=num_steps,
        tensorboard=False,
        start_step=start_step,
        redo_step=redo_step,
    ).close()
    return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_a_resumed_run_drops_the_records_it_will_write_again(tmp_path):
    lines = [json.dumps({"step": step, "train/loss": 1.0}) for step in range(1, 7)]
    lines.insert(4, json.dumps({"step": 4, "eval_8/loss": 0.5}))  # a periodic evaluation at 4
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "tr')  # torn
    kept = _start(tmp_path, start_step=4, num_steps=8)
    assert [(r["step"], "eval_8/loss" in r) for r in kept] == [
        (1, False),
        (2, False),
        (3, False),
        (4, False),
        (4, True),
    ]
    # An evaluation done again at the step resumed from: its record goes too.
    assert [r["step"] for r in _start(tmp_path, start_step=4, num_steps=8, redo_step=4)] == [
        1,
        2,
        3,
        4,
    ]


def test_hparams_go_to_tensorboard(tmp_path):
    logger = MetricsLogger(str(tmp_path), every_steps=1, num_steps=1, tensorboard=True)
    logger.write_hparams({"pe.name": "rope", "eval.lengths": (8, 16), "seed": 0}, ["train/loss"])
    logger.close()
    events = b"".join(path.read_bytes() for path in (tmp_path / "tensorboard").iterdir())
    assert b"_hparams_/experiment" in events and b"pe.name" in events and b"(8, 16)" in events


VOCAB = 5


def _config(readout):
    return tiny_config(
        **{
            "model.d_model": 12,
            "model.num_heads": 3,
            "model.num_layers": 2,
            "model.mlp_ratio": 3,
            "model.readout": readout,
            "pe.train_context": 6,
            "pe.name": "rope",
            "data.freq_index": 1,
            "data.second_freq_index": 1,
            "batch_size": 3,
        }
    )


def _by_hand(cfg, vocab):
    """Every matmul of the step, as (rows, fan_in, fan_out), and every visible (query, key) pair."""
    m = cfg.model
    b, t, d, f, h = (
        cfg.batch_size,
        cfg.pe.train_context,
        m.d_model,
        m.mlp_ratio * m.d_model,
        m.head_dim,
    )
    matmuls, pairs = [], 0
    for layer in range(m.num_layers):
        last_only = m.readout == "last" and layer == m.num_layers - 1
        query_rows = range(t - 1, t) if last_only else range(t)
        rows = b * len(query_rows)
        # k and v on every position, q on the query rows only.
        matmuls += [(b * t, d, d), (b * t, d, d), (rows, d, d)]
        matmuls += [(rows, d, d), (rows, d, f), (rows, f, d)]  # output projection, MLP up, MLP down
        for _ in range(b * m.num_heads):
            for query in query_rows:
                pairs += sum(1 for key in range(t) if key <= query)
    matmuls.append((rows, d, vocab))  # tied readout
    forward_dense = sum(2 * r * i * o for r, i, o in matmuls)
    # One score and one probability-weighted value per visible pair.
    forward_attention = pairs * (2 * h + 2 * h)
    return 3 * forward_dense, 3 * forward_attention


@pytest.mark.parametrize("readout", ["all", "last"])
def test_count_matches_a_matmul_by_matmul_count(readout):
    cfg = _config(readout)
    flops = model_flops_per_step(cfg.model, cfg.batch_size, cfg.pe.train_context, VOCAB)
    dense, attention = _by_hand(cfg, VOCAB)
    assert flops["dense"] == dense and flops["attention"] == attention
    assert flops["total"] == dense + attention


def test_dense_part_is_six_times_matmul_parameters_times_tokens():
    cfg = _config("all")
    model = nnx.eval_shape(
        lambda: Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))
    )
    kernels = [model.embedding]  # the tied readout
    for block in model.blocks:
        kernels += [block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down]
    matmul_params = sum(math.prod(kernel.shape) for kernel in kernels)
    tokens = cfg.batch_size * cfg.pe.train_context
    assert (
        model_flops_per_step(cfg.model, cfg.batch_size, cfg.pe.train_context, VOCAB)["dense"]
        == 6 * matmul_params * tokens
    )


def test_the_flop_count_takes_the_sizes_and_builds_no_data_source(monkeypatch):
    from jrope.data import source

    def refuse(*args, **kwargs):
        raise AssertionError("model_flops_per_step built a data source")

    monkeypatch.setattr(source, "build_source", refuse)
    cfg = _config("last")
    assert model_flops_per_step(cfg.model, cfg.batch_size, cfg.pe.train_context, 3)["total"] > 0
    with pytest.raises(TypeError):  # neither vocab_size nor channels
        model_flops_per_step(cfg.model, cfg.batch_size, cfg.pe.train_context)


def test_a_signal_model_counts_its_input_projection_and_regression_head():
    # Readout 'all': every matmul's parameters are used once per position, as for tokens.
    cfg = _config("all")
    channels_in, channels_out = 3, 2
    model = nnx.eval_shape(
        lambda: Transformer(
            cfg.model,
            run_encoding(cfg),
            None,
            input_channels=channels_in,
            output_channels=channels_out,
            rngs=nnx.Rngs(params=0),
        )
    )
    kernels = [model.input_projection, model.regression_head]
    for block in model.blocks:
        kernels += [block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down]
    matmul_params = sum(math.prod(kernel.shape) for kernel in kernels)
    tokens = cfg.batch_size * cfg.pe.train_context
    flops = model_flops_per_step(
        cfg.model,
        cfg.batch_size,
        cfg.pe.train_context,
        input_channels=channels_in,
        output_channels=channels_out,
    )
    assert flops["dense"] == 6 * matmul_params * tokens


def test_a_later_evaluation_joins_the_metrics_and_tensorboard_under_the_training_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jrope.train import evaluation

    rows = [
        {"length": length, "distance": None, "loss": loss, "accuracy": 0.5}
        for length, loss in ((256, 0.25), (4096, math.inf))
    ]
    (tmp_path / outputs.METRICS_FILE).write_text('{"step": 8, "time": 0, "train/loss": 1.0}\n')
    evaluation.log_evaluation(str(tmp_path), 8, True, "classification", rows)
    lines = (tmp_path / outputs.METRICS_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["train/loss"] == 1.0  # the training run's lines stay
    assert [{k: v for k, v in r.items() if k != "time"} for r in records[1:]] == [
        {"step": 8, "eval_256/loss": 0.25, "eval_256/accuracy": 0.5},
        {"step": 8, "eval_4096/loss": "inf", "eval_4096/accuracy": 0.5},
    ]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (scalar,) = events.Scalars("eval_256/loss")
    assert (scalar.step, scalar.value) == (8, 0.25)


def test_the_start_record_names_the_code_version_and_its_commit():
    import subprocess

    record = outputs.start_record(tiny_config().to_json_dict(), 0)["jrope"]
    assert record["version"] != "not installed"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(outputs.__file__))))
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        assert "commit" not in record  # an installed copy: no checkout to name
        return
    assert record["commit"] == head and isinstance(record["clean"], bool)
