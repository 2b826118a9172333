"""The MusicNet audio LM config: the reference's settings and methods, the clear failure without
prepared data, and a tiny run on tokens prepared from synthesised WAVs."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from configs import audio_lm_musicnet
from jrope.data import audio
from jrope.errors import ConfigError
from jrope.train import setup
from jrope.train.config import TrainConfig
from jrope.train.setup import run_encoding
from jrope.train.trainer import train_and_evaluate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reference_settings_and_every_method_builds():
    cfg = TrainConfig.from_config_dict(audio_lm_musicnet.get_config())
    assert (cfg.model.d_model, cfg.model.num_heads, cfg.model.num_layers) == (192, 4, 3)
    assert (cfg.data.seq_len, cfg.batch_size, cfg.num_steps) == (256, 32, 300)
    assert cfg.eval.lengths == (256, 512, 1024) and cfg.data.source == "audio_tokens"
    assert cfg.pe.name == "jordan_exact_m3_c010_eta100_eta1"
    assert (cfg.pe.order, cfg.pe.init_gamma * 256) == (3, pytest.approx(0.1))
    assert (cfg.pe.init_eta, cfg.pe.eta_max) == (0.1, 1.0)
    assert len(audio_lm_musicnet.METHODS) == 8
    for method in audio_lm_musicnet.METHODS:
        config = audio_lm_musicnet.get_config()
        config.pe.name = method
        _ = run_encoding(TrainConfig.from_config_dict(config))  # head_dim 48 fits orders 2, 3, 4


def test_training_without_prepared_tokens_stops_with_the_preparation_command(tmp_path):
    config = audio_lm_musicnet.get_config()
    config.data.path = config.data.eval_path = str(tmp_path / "absent")
    with pytest.raises(ConfigError) as raised:
        setup.check_run(TrainConfig.from_config_dict(config), str(tmp_path / "run"))
    message = str(raised.value)
    assert "python -m jrope.data.audio --wav_dir=WAVS" in message
    assert "zenodo.org/records/5120004" in message and "data.eval_path" in message


@pytest.mark.slow
def test_train_command_fails_clearly_without_data(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "train.py"),
            f"--config={os.path.join(REPO_ROOT, 'configs', 'audio_lm_musicnet.py')}",
            f"--config.data.path={tmp_path / 'absent'}",
            f"--config.data.eval_path={tmp_path / 'absent'}",
            f"--workdir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert result.returncode != 0
    assert "python -m jrope.data.audio --wav_dir=WAVS" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_tiny_audio_lm_on_synthesised_wavs(tmp_path):
    wavs = tmp_path / "wavs"
    wavs.mkdir()
    for index, frequency in enumerate((220, 440, 880, 1760, 3520)):
        t = np.arange(16_000) / 16_000
        tone = 0.5 * np.sin(2 * np.pi * frequency * t) * (1 + 0.5 * np.sin(2 * np.pi * index * t))
        soundfile.write(wavs / f"tone_{frequency}.wav", tone, 16_000)
    audio.prepare_audio_tokens(str(wavs), str(tmp_path / "tokens"))
    config = audio_lm_musicnet.get_config()
    config.data.path = config.data.eval_path = str(tmp_path / "tokens")
    config.model.d_model, config.model.num_heads, config.model.num_layers = 48, 2, 1
    config.pe.train_context = 32
    config.num_steps, config.batch_size = 2, 8
    config.mesh.data = -1
    config.eval.lengths, config.eval.num_sequences, config.eval.batch_size = (32, 64), 8, 8
    config.log.tensorboard = False
    rows = train_and_evaluate(TrainConfig.from_config_dict(config), str(tmp_path / "run"))["eval"]
    assert [row["length"] for row in rows] == [32, 64]
    for row in rows:
        assert math.isfinite(row["loss"]) and row["bits_per_byte"] == pytest.approx(
            row["loss"] / math.log(2.0)
        )
