"""A gs:// workdir, offline: every writer reaches the bucket, nothing lands on the local disk.

tests/helpers/fake_gcs.py sends gs:// (through etils.epath and fsspec) to an
in-memory store that, like GCS, refuses appends. Each test runs in an empty
local folder and checks it stays empty: no `gs:/bucket/...` folder appears.
"""

import io
import json
import os
import struct
import subprocess
import sys
import time

import pytest
from etils import epath
from helpers import fake_gcs
from tensorboardX.proto import event_pb2

from configs import kernel_probe as kernel_probe_config
from jrope import results
from jrope.data import files
from jrope.experiments import compare, kernel_probe
from jrope.train import checkpoints, evaluation
from jrope.train.outputs import MetricsLogger

RUN = "gs://bucket/run"


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    """The fake GCS with one bucket, `bucket`; the test runs in an empty local folder."""
    filesystem = fake_gcs.install(monkeypatch)
    monkeypatch.chdir(tmp_path)
    yield filesystem
    assert fake_gcs.local_entries(tmp_path) == []  # nothing fell back to a local folder


def _event_scalars(data: bytes) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of a TensorBoard event file (TFRecord framing)."""
    scalars, stream = {}, io.BytesIO(data)
    while header := stream.read(12):
        (length,) = struct.unpack("Q", header[:8])
        event = event_pb2.Event.FromString(stream.read(length))
        stream.read(4)  # the data's checksum
        for value in event.summary.value:
            scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _log_steps(steps, workdir=RUN):
    logger = MetricsLogger(
        workdir,
        every_steps=1,
        num_steps=max(steps),
        tensorboard=True,
        start_step=min(steps) - 1,
    )
    for step in steps:
        logger.write_step(step, {"loss": 1.0 / step, "grad_norm": 0.5})
    logger.close()


def test_metrics_and_tensorboard_are_written_to_the_bucket(bucket):
    _log_steps([1, 2, 3])
    lines = (epath.Path(RUN) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    event_files = list((epath.Path(RUN) / "tensorboard").iterdir())
    assert len(event_files) == 1 and event_files[0].name.startswith("events.out.tfevents.")
    scalars = _event_scalars(event_files[0].read_bytes())
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3]
    assert scalars["train/loss"][1][1] == pytest.approx(0.5)


def test_a_resumed_run_keeps_the_metrics_already_in_the_bucket(bucket):
    _log_steps([1, 2])
    _log_steps([3, 4])
    lines = (epath.Path(RUN) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_the_bucket_log_is_rewritten_whole_at_most_every_interval(bucket, monkeypatch):
    log = results.JsonLinesLog(epath.Path(RUN) / "log.jsonl")
    log.write("a")
    assert not (epath.Path(RUN) / "log.jsonl").exists()  # buffered: no upload per line
    monkeypatch.setattr(files, "UPLOAD_INTERVAL_S", 0.0)
    log.write("b")
    assert (epath.Path(RUN) / "log.jsonl").read_text() == "a\nb\n"
    log.close()


def test_evaluation_results_are_written_to_the_bucket(bucket):
    rows = [
        {
            "method": "rope",
            "seed": 0,
            "step": 7,
            "length": length,
            "distance": None,
            "num_sequences": 4,
            "loss": 1.0,
            "accuracy": 0.5,
            "bits_per_byte": 1.4427,
            "r2": float("nan"),
            "r2_pooled": float("nan"),
        }
        for length in (16, 32)
    ]
    out_dir = evaluation.results_dir(RUN, 7)
    paths = evaluation.write_results(rows, out_dir, task="language_model")
    assert str(out_dir) == f"{RUN}/eval_step7"
    assert all(path.exists() for path in paths.values())
    assert paths["png"].read_bytes().startswith(b"\x89PNG")
    # A later evaluation of the same step merges its rows into the same folder.
    evaluation.write_results_atomically(rows[:1], out_dir, task="language_model")
    assert [row["length"] for row in evaluation.read_results(out_dir)] == [16]


def test_the_comparison_reads_and_writes_the_bucket(bucket):
    rows = [
        {
            "method": "rope",
            "seed": seed,
            "step": 2,
            "length": 16,
            "distance": None,
            "num_sequences": 4,
            "loss": 1.0,
            "accuracy": accuracy,
            "bits_per_byte": float("nan"),
            "r2": float("nan"),
            "r2_pooled": float("nan"),
        }
        for seed, accuracy in enumerate([0.5, 0.7])
    ]
    compare.write_comparison(rows, "gs://bucket/comparison")
    root = epath.Path("gs://bucket/comparison")
    assert "| rope | 2 |" in (root / "comparison.md").read_text()
    assert (root / "comparison.png").exists()
    assert len((root / "comparison.csv").read_text().splitlines()) == 3


@pytest.mark.slow
def test_the_kernel_probe_writes_to_the_bucket(bucket):
    config = kernel_probe_config.get_config()
    config.probe.methods = ("rope",)
    config.probe.seeds = (0,)
    config.probe.train_context = 64
    config.probe.train_points = 48
    config.probe.eval_contexts = (64,)
    kernel_probe.run(config, "gs://bucket/probe")
    names = {path.name for path in epath.Path("gs://bucket/probe").iterdir()}
    assert {"kernel_probe.csv", "kernel_probe.md"} <= names


def test_the_checkpoint_uri_reaches_orbax_unchanged(bucket, monkeypatch):
    received = []

    class Recorder:
        def __init__(self, directory, **kwargs):
            received.append(os.fspath(directory))

    monkeypatch.setattr(checkpoints.ocp, "CheckpointManager", Recorder)
    checkpoints.Checkpointer(
        epath.Path(RUN) / "checkpoints", every_steps=1, max_to_keep=1, config_json={}
    )
    assert received == [f"{RUN}/checkpoints"]


def test_a_reachable_bucket_passes_and_a_missing_one_is_named(bucket):
    assert files.uri_problem(RUN, "--workdir") is None
    problem = files.uri_problem("gs://no-such-bucket/run", "--workdir")
    assert "bucket gs://no-such-bucket does not exist" in problem
    assert "gcloud storage buckets create gs://no-such-bucket" in problem
    problem = files.uri_problem("gs://bucket/text.txt", "data.path =", must_exist=True)
    assert (
        problem
        == "data.path = gs://bucket/text.txt does not exist in bucket gs://bucket; fix the path."
    )
    assert "not a local path" in files.uri_problem("http://host/run", "--workdir")


def test_a_bucket_that_does_not_answer_is_given_up_on_and_named(bucket, monkeypatch):
    monkeypatch.setattr(fake_gcs.FakeGCS, "exists", lambda self, path, **kw: time.sleep(5))
    start = time.monotonic()
    problem = files.uri_problem(RUN, "--workdir", timeout_s=0.2)
    assert time.monotonic() - start < 2
    assert problem.startswith(
        "--workdir gs://bucket/run: bucket gs://bucket did not answer within 0.2 s"
    )


@pytest.mark.slow
def test_offline_a_gs_workdir_fails_within_a_minute_naming_the_bucket(tmp_path):
    # The real environment: no fake filesystem. Without gcsfs the bucket cannot be
    # opened at all; with it, offline, the bucket does not answer: either way the
    # run stops before compiling, names the bucket, and writes nothing locally.
    command = [
        sys.executable, os.path.join(os.getcwd(), "train.py"),
        f"--config={os.path.join(os.getcwd(), 'configs/synthetic_cpu.py')}",
        "--workdir=gs://jrope-offline-bucket/run", "--config.num_steps=1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert time.monotonic() - start < 60
    assert result.returncode != 0
    assert "gs://jrope-offline-bucket" in result.stderr
    assert fake_gcs.local_entries(tmp_path) == []
