"""Audio token preparation on synthesised WAVs: sizes, separators, mel bands, truncation, the
split, reproducibility, the clear failures, and the 'audio_tokens' byte source over the output."""

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import soundfile

from jrope.data import audio
from jrope.data.text_bytes import ByteTextSource, TextDataConfig

SETTINGS = audio.MelTokenSettings()
LONG_TAIL_HZ = 5000.0  # the long file's tone after 10 s, which truncation must drop


def _tone(frequency_hz, seconds, rate):
    t = np.arange(round(seconds * rate)) / rate
    return 0.5 * np.sin(2 * np.pi * frequency_hz * t)


def _wav_specs():
    """relative path -> (tone Hz, samples at 16 kHz after reading); tones lie well inside a band."""
    specs = {}
    for index, frequency in enumerate((200, 440, 1000, 1500, 2300, 3400, 6000, 7300)):
        folder = "train_data" if index % 2 else "test_data"  # MusicNet's layout: found recursively
        samples = 16_000 * (6 + index) // 10  # 0.6 .. 1.3 s
        specs[f"{folder}/tone_{frequency}.wav"] = (frequency, samples)
    # 50,000 frames at 44.1 kHz read as ceil(50,000 * 16,000 / 44,100) at 16 kHz.
    specs["other_rate/stereo_800.WAV"] = (800, math.ceil(50_000 * (16_000 / 44_100)))
    specs["long_640.wav"] = (640, 160_000)  # 12 s on disk, 10 s read
    return specs


@pytest.fixture(scope="module")
def wav_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wavs")
    for name, (frequency, samples) in _wav_specs().items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("other_rate"):
            tone = _tone(frequency, 50_000 / 44_100, 44_100)
            soundfile.write(path, np.stack([tone, 0.5 * tone], axis=1), 44_100)  # stereo
        elif name.startswith("long"):
            ten_seconds = _tone(frequency, 10.0, 16_000)
            soundfile.write(
                path, np.concatenate([ten_seconds, _tone(LONG_TAIL_HZ, 2.0, 16_000)]), 16_000
            )
        else:
            soundfile.write(path, _tone(frequency, samples / 16_000, 16_000), 16_000)
    (root / ".hidden.wav").write_bytes(b"not audio")  # hidden: skipped
    (root / "notes.txt").write_text("not a wav")
    return root


@pytest.fixture(scope="module")
def prepared(wav_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tokens")
    manifest = audio.prepare_audio_tokens(str(wav_dir), str(out_dir), seed=7)
    return out_dir, manifest


def _frames(samples):
    return 1 + samples // SETTINGS.hop_length


def _files_tokens(out_dir, manifest, split):
    """name -> that file's tokens (its separator first), cut from the split's token file."""
    data = np.fromfile(out_dir / manifest["splits"][split]["file"], np.uint8)
    specs = _wav_specs()
    pieces, start = {}, 0
    for name in manifest["splits"][split]["wavs"]:
        size = 1 + _frames(specs[name][1]) * SETTINGS.n_mels
        pieces[name] = data[start : start + size]
        start += size
    assert start == len(data)
    return pieces


def _slaney_hz_to_mel(hz):
    return 3 * hz / 200 if hz < 1000 else 15 + 27 * math.log(hz / 1000) / math.log(6.4)


def _slaney_mel_to_hz(mel):
    return 200 * mel / 3 if mel < 15 else 1000 * math.exp((mel - 15) * math.log(6.4) / 27)


def _band_edges_hz():
    top = _slaney_hz_to_mel(SETTINGS.sample_rate / 2)
    step = top / (SETTINGS.n_mels + 1)
    return [_slaney_mel_to_hz(i * step) for i in range(SETTINGS.n_mels + 2)]


def test_token_files_sizes_and_separators(prepared):
    out_dir, manifest = prepared
    specs = _wav_specs()
    for split in ("train", "eval"):
        info = manifest["splits"][split]
        size = os.path.getsize(out_dir / info["file"])
        frames = sum(_frames(specs[name][1]) for name in info["wavs"])
        assert size == info["bytes"] == frames * 32 + len(info["wavs"])
        assert info["frames"] == frames
        for tokens in _files_tokens(out_dir, manifest, split).values():
            assert tokens[0] == audio.FILE_SEPARATOR
            assert tokens[1:].max() == 255  # each file's loudest cell is its 0 dB
    assert json.loads((out_dir / "manifest.json").read_text()) == manifest
    assert manifest["settings"] == {
        "sample_rate": 16_000,
        "max_seconds": 10.0,
        "n_fft": 1024,
        "hop_length": 512,
        "n_mels": 32,
    }


def test_brightest_band_is_nearest_the_tone(prepared):
    out_dir, manifest = prepared
    centres = np.array(_band_edges_hz()[1:-1])
    specs = _wav_specs()
    checked = 0
    for split in ("train", "eval"):
        for name, tokens in _files_tokens(out_dir, manifest, split).items():
            frames = tokens[1:].reshape(-1, 32)  # frame-major: a frame's 32 bands are adjacent
            frequency = specs[name][0]
            nearest = int(np.argmin(np.abs(centres - frequency)))
            assert int(np.argmax(frames.astype(int).sum(axis=0))) == nearest, name
            # Every frame away from the edges peaks in that band, too.
            assert np.all(np.argmax(frames[2:-2], axis=1) == nearest), name
            checked += 1
    assert checked == len(specs)


def test_long_file_is_cut_at_10_seconds(prepared):
    out_dir, manifest = prepared
    tokens = {
        **_files_tokens(out_dir, manifest, "train"),
        **_files_tokens(out_dir, manifest, "eval"),
    }
    frames = tokens["long_640.wav"][1:].reshape(-1, 32)
    assert len(frames) == 1 + 160_000 // 512  # 10 s at 16 kHz, not 12
    tail_band = int(np.argmin(np.abs(np.array(_band_edges_hz()[1:-1]) - LONG_TAIL_HZ)))
    # The 5 kHz tone after 10 s never reaches the output (it would be at 0 dB, byte 255).
    assert frames[:, tail_band].max() < 64


def test_split_is_80_20_and_follows_the_seed(wav_dir, prepared, tmp_path):
    _, manifest = prepared
    train, evaluation = manifest["splits"]["train"]["wavs"], manifest["splits"]["eval"]["wavs"]
    names = sorted(_wav_specs())
    assert (len(train), len(evaluation)) == (8, 2)
    assert sorted(train + evaluation) == names
    shuffled = list(names)
    random.Random(7).shuffle(shuffled)  # the reference's split: the first 20 % of a seeded shuffle
    assert evaluation == shuffled[:2] and train == shuffled[2:]
    other = audio.prepare_audio_tokens(str(wav_dir), str(tmp_path), seed=8)
    assert other["splits"]["eval"]["wavs"] != evaluation


def _archive(wav_dir, path, names):
    """A tar.gz of ``names`` (paths under wav_dir) in that order, with a folder entry first."""
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        tar.add(wav_dir / "train_data", arcname="musicnet/train_data", recursive=False)
        tar.add(wav_dir / "notes.txt", arcname="musicnet/notes.txt")
        for name in names:
            tar.add(wav_dir / name, arcname=f"musicnet/{name}")
    return path


def test_archive_gives_its_first_wavs_in_archive_order(wav_dir, prepared, tmp_path):
    """The reference's file choice: the first N '.wav' members of the archive, split in that order."""
    out_dir, folder_manifest = prepared
    specs = _wav_specs()
    # An order far from sorted; the upper-case '.WAV' member is no '.wav' to the reference.
    names = sorted(specs, key=lambda name: specs[name][0], reverse=True)
    archive = _archive(wav_dir, tmp_path / "musicnet.tar.gz", names)
    lower_case = [f"musicnet/{name}" for name in names if name.endswith(".wav")]
    manifest = audio.prepare_audio_tokens(str(archive), str(tmp_path / "out"), seed=7, max_files=5)
    assert manifest["order"] == "archive"
    train, evaluation = manifest["splits"]["train"]["wavs"], manifest["splits"]["eval"]["wavs"]
    expected_train, expected_eval = audio.split_files(lower_case[:5], 0.2, 7)
    assert (train, evaluation) == (expected_train, expected_eval)
    first_five = lower_case[:5]
    random.Random(7).shuffle(first_five)  # the split shuffles the archive's order, not a sorted one
    assert evaluation == first_five[:1] and train == first_five[1:]
    # Each file's bytes are those the folder gives for the same WAV.
    folder_tokens = {
        **_files_tokens(out_dir, folder_manifest, "train"),
        **_files_tokens(out_dir, folder_manifest, "eval"),
    }
    data = np.fromfile(tmp_path / "out" / "train.u8", np.uint8)
    start = 0
    for member in train:
        expected = folder_tokens[member.removeprefix("musicnet/")]
        np.testing.assert_array_equal(data[start : start + expected.size], expected)
        start += expected.size
    assert start == data.size


def test_rerun_gives_identical_bytes(wav_dir, prepared, tmp_path):
    out_dir, _ = prepared
    audio.prepare_audio_tokens(str(wav_dir), str(tmp_path), seed=7)
    audio.prepare_audio_tokens(str(wav_dir), str(tmp_path), seed=7)  # over its own output
    for name in ("train.u8", "eval.u8", "manifest.json"):
        assert (tmp_path / name).read_bytes() == (out_dir / name).read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["eval.u8", "manifest.json", "train.u8"]


def test_mel_filterbank_matches_the_slaney_formula():
    bank = audio.mel_filterbank(SETTINGS)
    assert bank.shape == (32, 513)
    edges = _band_edges_hz()
    bin_hz = np.arange(513) * SETTINGS.sample_rate / SETTINGS.n_fft
    for band in (3, 21):  # one in the linear part of the scale (< 1 kHz), one in the log part
        low, centre, high = edges[band : band + 3]
        expected = [
            (2 / (high - low))
            * max(0.0, min((f - low) / (centre - low), (high - f) / (high - centre)))
            for f in bin_hz
        ]
        np.testing.assert_allclose(bank[band], expected, rtol=1e-9, atol=1e-15)
        assert np.count_nonzero(bank[band]) >= 2


def test_quantise_db_maps_80_db_onto_bytes():
    power = np.array([[1.0, 0.1], [1e-8, 0.0]])
    # 0 dB -> 255, -10 dB -> round(70 * 255 / 80) = 223, -80 dB and below -> 0
    np.testing.assert_array_equal(audio.quantise_db(power), [[255, 223], [0, 0]])
    np.testing.assert_array_equal(audio.quantise_db(4.0 * power), [[255, 223], [0, 0]])


@pytest.mark.parametrize("vocab_size", [256, 257])
def test_audio_tokens_source_yields_batches(prepared, vocab_size):
    out_dir, _ = prepared
    cfg = TextDataConfig(
        source="audio_tokens",
        path=str(out_dir),
        eval_path=str(out_dir / "eval.u8"),
        vocab_size=vocab_size,
        seq_len=64,
        seed=1,
    )
    source = ByteTextSource(cfg, 4, 0, 1)
    train_bytes = (out_dir / "train.u8").read_bytes()
    assert source.train_corpus.tobytes() == train_bytes  # the bytes as they are
    assert source.eval_corpus.tobytes() == (out_dir / "eval.u8").read_bytes()
    batch = source.train_batch(3)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 64)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    offset = vocab_size - 256
    for inputs, targets in zip(batch["inputs"], batch["targets"], strict=False):
        window = np.concatenate([inputs, targets[-1:]]) - offset
        assert window.min() >= 0 and window.astype(np.uint8).tobytes() in train_bytes
    evaluation = next(source.eval_batches(128, 2, 2))
    assert evaluation["inputs"].shape == (2, 128) and evaluation["inputs"].min() >= offset


def test_audio_tokens_source_errors(tmp_path):
    with pytest.raises(ValueError, match="needs both path"):
        TextDataConfig(source="audio_tokens", path=str(tmp_path))
    cfg = TextDataConfig(source="audio_tokens", path=str(tmp_path), eval_path=str(tmp_path))
    with pytest.raises(
        ValueError, match=r"(?s)train\.u8 does not exist.*python -m jrope\.data\.audio"
    ):
        ByteTextSource(cfg, 2, 0, 1)


def test_missing_or_empty_wav_dir_says_where_to_get_musicnet(tmp_path):
    missing = tmp_path / "musicnet"
    with pytest.raises(audio.DataUnavailable) as raised:
        audio.prepare_audio_tokens(str(missing), str(tmp_path / "out"))
    message = str(raised.value)
    assert str(missing) in message and "zenodo.org/records/5120004" in message
    assert "train_data/" in message and "tar -xzf musicnet.tar.gz" in message
    missing.mkdir()
    (missing / "only.wav").write_bytes(b"")
    with pytest.raises(audio.DataUnavailable, match="holds 1 .wav file"):
        audio.prepare_audio_tokens(str(missing), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_unreadable_wav_is_named(tmp_path):
    for name in ("a.wav", "b.wav"):
        (tmp_path / "wavs").mkdir(exist_ok=True)
        (tmp_path / "wavs" / name).write_bytes(b"RIFF but not really a wav file")
    with pytest.raises(ValueError, match=r"[ab]\.wav is not a readable audio file"):
        audio.prepare_audio_tokens(str(tmp_path / "wavs"), str(tmp_path / "out"))


def test_missing_audio_extra_names_the_install_command(wav_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "soxr", None)  # as if soxr were not installed
    with pytest.raises(audio.UsageError, match=r'pip install -e "\.\[train,audio\]"'):
        audio.prepare_audio_tokens(str(wav_dir), str(tmp_path))


def test_command_line_fails_clearly_without_wavs(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jrope.data.audio",
            f"--wav_dir={tmp_path / 'absent'}",
            f"--out_dir={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert result.returncode == 3
    assert "zenodo.org/records/5120004" in result.stderr and "Traceback" not in result.stderr
