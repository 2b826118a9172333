"""Byte tokens from audio (MusicNet) for the audio language model: quantised log-mel frames.

Each WAV file becomes the byte 0 followed by its log-mel frames, one byte per
mel band, frame-major (the ``n_mels`` bands of frame 0, then of frame 1,
...); a split's token file is its files' tokens concatenated. The settings
and every step are those of the paper's reference preparation
(ybzhang-nxu/jordan_rope, scripts/prepare_audio_lm_tokens.py,
``audio_to_tokens`` and ``split_items``):

  audio    the first ``max_seconds`` (10 s) at the file's own rate, channels
           averaged to mono (float32), resampled to 16 kHz with soxr's HQ
           filter and cut or zero-padded to ceil(n * 16000 / rate) samples
           (librosa.load's steps with its default soxr_hq);
  STFT     n_fft 1024, periodic Hann window of 1024, hop 512, frames centred
           by padding 512 zeros at both ends: 1 + n // 512 frames;
  mel      power spectrum |X|^2 through 32 triangular Slaney-scale filters
           over 0 .. 8 kHz, each scaled by 2 / (its width in Hz) (librosa's
           ``filters.mel`` defaults: htk=False, norm='slaney');
  dB       10 log10(max(1e-10, P)) relative to the file's largest P (so the
           loudest cell is 0 dB), floored at -80 dB (librosa's power_to_db
           with ref=np.max, amin=1e-10, top_db=80);
  bytes    round((dB + 80) * 255 / 80) clipped to 0 .. 255 (halves to even);
           a file with no samples gives the 0 byte alone;
  split    the files shuffled by ``random.Random(seed).shuffle`` (seed
           20260506), the first max(1, round(0.2 n)) of them for evaluation,
           the rest for training, each split in its shuffled order.

The 0 byte opens every file, the first included; 0 is also the byte of any
cell at the -80 dB floor, so it marks a file's start only by position.

Which files: of the archive ``musicnet.tar.gz``, the first ``max_files`` regular
``.wav`` members in archive order (16: the reference's corpus, read as its
``prepare_musicnet`` does; the split shuffles that list, so the order matters);
of a folder, every WAV under it in sorted path order (with MusicNet, another
corpus than the reference's). An unreadable file stops the run with its name.

Libraries: ``soundfile`` reads and ``soxr`` resamples (librosa's, without its
dependencies; the ``audio`` extra); the STFT, filterbank and dB scale are
numpy in float64, and gave librosa 0.11's bytes on WAVs at 8 to 48 kHz.

Output, in ``out_dir``, each file written atomically, the manifest last:
train.u8 and eval.u8 (raw uint8 tokens) and manifest.json (settings, seed,
the WAVs' source and order, each split's WAVs, frames and bytes).

Commands (the reference's 16 MusicNet files; a folder of WAVs instead):

    python -m jrope.data.audio --archive=musicnet.tar.gz --max_files=16 --out_dir=DIR
    python -m jrope.data.audio --wav_dir=DIR --out_dir=DIR [--seed=20260506]

The prepared folder is the 'audio_tokens' source of jrope.data.text_bytes
(``path`` and ``eval_path`` at it, or at the two files).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import tarfile
from collections.abc import Sequence

import numpy as np
from absl import logging
from etils import epath

from jrope.data.files import resolved, write_atomically
from jrope.errors import DataUnavailable, UsageError

SPLIT_FILES = {"train": "train.u8", "eval": "eval.u8"}
MANIFEST_FILE = "manifest.json"
FILE_SEPARATOR = 0  # the byte before each file's frames
DEFAULT_SEED = 20260506  # the reference's
DEFAULT_EVAL_FRACTION = 0.2

# Power floor (1e-10, i.e. -100 dB before referencing) and dynamic range of the dB scale.
_AMIN = 1e-10
_TOP_DB = 80.0

MUSICNET_DIRECTIONS = (
    "This command does not download MusicNet: get musicnet.tar.gz (md5\n"
    "844764911fa0d5b97c97da944a057590) from https://zenodo.org/records/5120004 and pass\n"
    "--archive=musicnet.tar.gz --max_files=16 (the reference's files), or unpack it\n"
    "(tar -xzf musicnet.tar.gz) and pass musicnet/ as --wav_dir: its train_data/ and\n"
    "test_data/ hold the .wav files (any folder of them works; searched recursively)."
)


@dataclasses.dataclass(frozen=True)
class MelTokenSettings:
    """How audio becomes bytes (defaults: the reference's)."""

    sample_rate: int = 16_000  # Hz the audio is resampled to
    max_seconds: float = 10.0  # leading seconds of each file that are read
    n_fft: int = 1024  # STFT frame and Hann window length, samples
    hop_length: int = 512  # STFT hop, samples
    n_mels: int = 32  # mel bands, i.e. bytes per frame


def _audio_libraries():
    """(soundfile, soxr), imported on first use so the package works without them."""
    try:
        import soundfile
        import soxr
    except ImportError as error:
        raise UsageError(
            f"Reading audio needs the optional 'audio' dependencies ({error.name} is missing); "
            'install them with\n    pip install -e ".[train,audio]"'
        ) from None
    return soundfile, soxr


# ---- Audio to bytes.


def read_mono(path, settings: MelTokenSettings, name: str | None = None) -> np.ndarray:
    """float32 [n]: the file's first ``max_seconds``, channels averaged, at ``sample_rate``.
    ``path``: a file path or a binary file object; ``name``: how errors call it."""
    soundfile, soxr = _audio_libraries()
    try:
        with soundfile.SoundFile(path) as wav:
            native_rate, frames = wav.samplerate, int(settings.max_seconds * wav.samplerate)
            samples = wav.read(frames=frames, dtype="float32", always_2d=True)
    except soundfile.SoundFileError as error:
        raise UsageError(
            f"{name or path} is not a readable audio file ({error}); remove or replace it."
        ) from None
    mono = samples.mean(axis=1)
    if native_rate == settings.sample_rate or mono.size == 0:
        return mono
    resampled = soxr.resample(mono, native_rate, settings.sample_rate, quality="HQ")
    # librosa fixes the length to ceil(n * ratio): soxr's own count may differ by a sample.
    length = math.ceil(mono.size * (settings.sample_rate / native_rate))
    return np.pad(resampled[:length], (0, max(0, length - resampled.size)))


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (200/3 Hz per mel), logarithmic above."""
    hz = np.asarray(hz, np.float64)
    linear = hz / (200.0 / 3.0)
    # Both branches are evaluated everywhere: the floor keeps log(0) out of the unused one.
    logarithmic = 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, logarithmic, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """The inverse of ``hz_to_mel``."""
    mel = np.asarray(mel, np.float64)
    linear = mel * (200.0 / 3.0)
    logarithmic = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, logarithmic, linear)


def mel_filterbank(settings: MelTokenSettings) -> np.ndarray:
    """float64 [n_mels, n_fft // 2 + 1]: Slaney-normalised triangles over the FFT bins' Hz."""
    # Band k rises from edge k, peaks at k + 1, falls to k + 2.
    top = hz_to_mel(settings.sample_rate / 2)
    edges = mel_to_hz(np.linspace(0.0, top, settings.n_mels + 2))[:, None]
    bin_hz = np.fft.rfftfreq(settings.n_fft, d=1.0 / settings.sample_rate)
    rising = (bin_hz - edges[:-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[2:] - bin_hz) / (edges[2:] - edges[1:-1])
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    return triangles * (2.0 / (edges[2:] - edges[:-2]))  # equal area: constant energy per band


def mel_power(audio: np.ndarray, settings: MelTokenSettings) -> np.ndarray:
    """float64 [1 + n // hop_length, n_mels]: mel-filtered power spectra of centred frames."""
    half = settings.n_fft // 2
    padded = np.pad(np.asarray(audio, np.float64), half)  # zeros, so frame t centres on t * hop
    frames = np.lib.stride_tricks.sliding_window_view(padded, settings.n_fft)
    frames = frames[:: settings.hop_length]
    periodic_hann = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(settings.n_fft) / settings.n_fft)
    spectra = np.fft.rfft(frames * periodic_hann, axis=-1)
    power = spectra.real**2 + spectra.imag**2
    return power @ mel_filterbank(settings).T


def quantise_db(power: np.ndarray) -> np.ndarray:
    """uint8, shape of ``power``: dB relative to the largest cell, [-80, 0] dB onto 0 .. 255."""
    db = 10.0 * np.log10(np.maximum(_AMIN, power))
    # An all-silent file has reference _AMIN: every cell is then 0 dB (255), as in the reference.
    db -= 10.0 * np.log10(max(_AMIN, float(power.max())))
    db = np.maximum(db, db.max() - _TOP_DB)
    return np.clip(np.round((db + _TOP_DB) * (255.0 / _TOP_DB)), 0, 255).astype(np.uint8)


def audio_file_tokens(path, settings: MelTokenSettings, name: str | None = None) -> np.ndarray:
    """uint8 [1 + frames * n_mels]: the separator, then the file's frames, frame-major
    (``path`` and ``name`` as in read_mono)."""
    audio = read_mono(path, settings, name)
    if audio.size == 0:
        return np.array([FILE_SEPARATOR], np.uint8)
    frames = quantise_db(mel_power(audio, settings))  # [frames, n_mels]
    return np.concatenate([np.array([FILE_SEPARATOR], np.uint8), frames.reshape(-1)])


# ---- Files and splits.


def find_wav_files(wav_dir: str) -> list[str]:
    """Paths relative to ``wav_dir`` of its .wav files (any case, not hidden), sorted."""
    found = []
    for root, dirs, names in os.walk(wav_dir):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.lower().endswith(".wav") and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(root, name), wav_dir))
    # Sorted as '/'-separated paths, so the order (and the split) is the same on every OS.
    return sorted(p.replace(os.sep, "/") for p in found)


def archive_wav_members(archive: str, max_files: int | None) -> dict[str, bytes]:
    """{name: bytes} of the first ``max_files`` (all when None) regular members of a tar archive
    whose names end in '.wav' (the reference's test), in archive order."""
    members = {}
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            if max_files is not None and len(members) == max_files:
                break
            if member.isfile() and member.name.endswith(".wav"):
                members[member.name] = tar.extractfile(member).read()
    return members


def split_files(
    files: Sequence[str], eval_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    """(train, eval): the files shuffled with ``random.Random(seed)``, the first
    max(1, round(eval_fraction * n)) for evaluation (none when n == 1)."""
    shuffled = list(files)
    random.Random(seed).shuffle(shuffled)
    eval_count = max(1, round(len(shuffled) * eval_fraction)) if len(shuffled) > 1 else 0
    return shuffled[eval_count:], shuffled[:eval_count]


def prepare_audio_tokens(
    wav_source: str,
    out_dir: str,
    *,
    seed: int = DEFAULT_SEED,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    max_files: int | None = None,
    settings: MelTokenSettings = MelTokenSettings(),
) -> dict:
    """Writes train.u8, eval.u8 and manifest.json into ``out_dir``; returns the manifest.

    ``wav_source``: a tar archive (its WAV members in archive order) or a
    folder (its WAVs, recursively, in sorted path order); ``max_files`` keeps
    the first few of that order. DataUnavailable where it is missing or
    holds fewer than two WAVs.
    """
    if not 0.0 < eval_fraction < 1.0 or (max_files is not None and max_files < 2):
        raise UsageError(
            f"eval_fraction must lie in (0, 1) and max_files be at least 2 (train and eval), got "
            f"{eval_fraction} and {max_files}."
        )
    wav_source = os.path.abspath(os.path.expanduser(wav_source))
    if os.path.isdir(wav_source):
        order = "sorted path"
        wavs = find_wav_files(wav_source)[:max_files]
        archive_members = None
    elif os.path.isfile(wav_source) and tarfile.is_tarfile(wav_source):
        order = "archive"
        archive_members = archive_wav_members(wav_source, max_files)
        wavs = list(archive_members)
    else:
        raise DataUnavailable(
            f"{wav_source} is neither a folder nor a tar archive.\n{MUSICNET_DIRECTIONS}"
        )
    if len(wavs) < 2:
        raise DataUnavailable(
            f"{wav_source} holds {len(wavs)} .wav file(s); at least 2 are needed, "
            f"one for evaluation.\n{MUSICNET_DIRECTIONS}"
        )
    train_wavs, eval_wavs = split_files(wavs, eval_fraction, seed)
    if not train_wavs:
        raise UsageError(
            f"eval_fraction {eval_fraction} leaves none of the {len(wavs)} WAVs for training; "
            "lower it or add WAVs."
        )
    _audio_libraries()  # fail before any work when the extra is missing
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    manifest = {
        "format": (
            "raw uint8 tokens: per WAV the byte 0, then n_mels bytes per frame, frame-major; "
            "byte = round((dB + 80) * 255 / 80), dB of mel power relative to the WAV's maximum"
        ),
        "settings": dataclasses.asdict(settings),
        "seed": seed,
        "eval_fraction": eval_fraction,
        "wav_source": wav_source,
        "order": order,
        "splits": {},
    }
    for split, split_wavs in (("train", train_wavs), ("eval", eval_wavs)):
        pieces = []
        for index, name in enumerate(split_wavs):
            if archive_members is None:
                pieces.append(audio_file_tokens(os.path.join(wav_source, name), settings))
            else:
                member = io.BytesIO(archive_members[name])
                pieces.append(audio_file_tokens(member, settings, name))
            if (index + 1) % 50 == 0:
                logging.info("%s: %d of %d WAVs", split, index + 1, len(split_wavs))
        tokens = np.concatenate(pieces)
        write_atomically(os.path.join(out_dir, SPLIT_FILES[split]), [tokens.tobytes()])
        manifest["splits"][split] = {
            "file": SPLIT_FILES[split],
            "bytes": int(tokens.size),
            "frames": (int(tokens.size) - len(split_wavs)) // settings.n_mels,
            "wavs": split_wavs,
        }
    text = json.dumps(manifest, indent=2) + "\n"
    write_atomically(os.path.join(out_dir, MANIFEST_FILE), [text.encode("utf-8")])
    return manifest


def token_file(path: str, split: str) -> epath.Path:
    """The split's .u8 file: ``path`` itself, or in the folder ``path`` (local or a bucket)."""
    location = resolved(path)
    return location / SPLIT_FILES[split] if location.is_dir() else location


def load_token_file(path: str, split: str) -> np.ndarray:
    """A prepared split's tokens as a read-only uint8 [n] memory map; ``path``: the split's
    local .u8 file, or the folder holding train.u8 and eval.u8."""
    path = os.fspath(token_file(path, split))
    if not os.path.isfile(path):
        raise ValueError(
            f"Audio token file {path} does not exist; write it with python -m jrope.data.audio "
            "--wav_dir=WAVS --out_dir=DIR (or --archive=musicnet.tar.gz --max_files=16, from "
            "https://zenodo.org/records/5120004) and point data.path and data.eval_path at DIR."
        )
    return np.memmap(path, dtype=np.uint8, mode="r")


def _cli() -> None:
    """``python -m jrope.data.audio``: prepare the token files and print the manifest's counts."""
    from absl import flags

    from jrope import command_line

    wav_dir = flags.DEFINE_string("wav_dir", None, "Folder of .wav files, searched recursively.")
    archive = flags.DEFINE_string("archive", None, "Tar archive of .wav files (musicnet.tar.gz).")
    out_dir = flags.DEFINE_string("out_dir", None, "Folder to write to.", required=True)
    seed = flags.DEFINE_integer("seed", DEFAULT_SEED, "Seed of the train/eval file split.")
    help_eval = "Fraction of the files held out for evaluation."
    eval_fraction = flags.DEFINE_float("eval_fraction", DEFAULT_EVAL_FRACTION, help_eval)
    help_max_files = "Only the first N WAVs (0: all); 16 of musicnet.tar.gz: the reference's."
    max_files = flags.DEFINE_integer("max_files", 0, help_max_files)
    flags.mark_flags_as_mutual_exclusive(["archive", "wav_dir"], required=True)

    def main(argv: Sequence[str]) -> None:
        source, options = archive.value or wav_dir.value, dict(seed=seed.value)
        options.update(eval_fraction=eval_fraction.value, max_files=max_files.value or None)
        manifest = prepare_audio_tokens(source, out_dir.value, **options)
        for split, info in manifest["splits"].items():
            print(
                f"{split}: {len(info['wavs'])} WAVs, {info['frames']} frames, "
                f"{info['bytes']} bytes in {os.path.join(out_dir.value, info['file'])}"
            )

    command_line.run(main)


if __name__ == "__main__":
    _cli()
