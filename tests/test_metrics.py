"""The progress line (tokens/s, MFU where the peak is known), metrics.jsonl after a resume, hparams."""

import dataclasses
import json
import re

import numpy as np
import pytest
from helpers.tiny_config import tiny_config

from jrope.train import throughput
from jrope.train.flops import model_flops_per_step
from jrope.train.metrics import MetricsLogger
from jrope.train.throughput import Throughput


@dataclasses.dataclass
class FakeDevice:
    device_kind: str


def test_peak_of_known_devices_and_none_for_the_rest():
    assert throughput.peak_flops_per_sec([FakeDevice("TPU v4")] * 8, "bfloat16") == 8 * 275e12
    # float32 at XLA's default precision: TF32 tensor cores on an A100.
    assert throughput.peak_flops_per_sec([FakeDevice("NVIDIA A100-SXM4-80GB")], "float32") == 156e12
    assert throughput.peak_flops_per_sec([FakeDevice("Tesla V100-SXM2-16GB")], "bfloat16") is None
    assert throughput.peak_flops_per_sec([FakeDevice("cpu")], "float32") is None


def test_tokens_per_second_and_mfu_from_the_step_rate():
    cfg = tiny_config()  # batch 8 x L 16
    rates = Throughput.for_run(cfg, {"vocab_size": 3}, [FakeDevice("TPU v5 lite")] * 2).rates(10.0)
    assert rates["tokens_per_sec"] == 10.0 * 8 * 16
    flops = model_flops_per_step(cfg, 3)["total"]
    assert rates["mfu"] == pytest.approx(10.0 * flops / (2 * 197e12))
    assert "mfu" not in Throughput.for_run(cfg, {"vocab_size": 3}, [FakeDevice("cpu")]).rates(10.0)


def _metrics(loss):
    return {"loss": np.float32(loss), "accuracy": np.float32(0.5), "grad_norm": np.float32(1.0)}


def test_progress_line_shows_step_loss_rates_and_time_left(tmp_path, capsys):
    known = Throughput(tokens_per_step=1000, model_flops_per_step=1e12, peak_flops_per_sec=1e14)
    logger = MetricsLogger(
        str(tmp_path),
        every_steps=2,
        num_steps=4,
        tensorboard=False,
        last_checkpoint=str,
        throughput=known,
    )
    for step in range(1, 5):
        logger.push(step, _metrics(1.0 / step))
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


def _start(workdir, *, start_step, num_steps):
    """A logger of a run (re)starting at `start_step`, closed at once: what it left in the log."""
    MetricsLogger(
        str(workdir),
        every_steps=1,
        num_steps=num_steps,
        tensorboard=False,
        last_checkpoint=str,
        start_step=start_step,
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
    # Resumed at the last step, the final evaluation is done again: its record goes too.
    assert [r["step"] for r in _start(tmp_path, start_step=4, num_steps=4)] == [1, 2, 3, 4]


def test_hparams_go_to_tensorboard(tmp_path):
    logger = MetricsLogger(
        str(tmp_path), every_steps=1, num_steps=1, tensorboard=True, last_checkpoint=str
    )
    logger.write_hparams({"pe.name": "rope", "eval.lengths": (8, 16), "seed": 0}, ["train/loss"])
    logger.close()
    events = b"".join(path.read_bytes() for path in (tmp_path / "tensorboard").iterdir())
    assert b"_hparams_/experiment" in events and b"pe.name" in events and b"(8, 16)" in events
