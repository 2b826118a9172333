"""The WikiText configs end to end: a tiny byte-level run on a temporary text file, and the
WikiText-103 config without data stopping at once with directions."""

import csv
import json
import math

import numpy as np
import pytest
from helpers.tiny_config import tiny_text_config_dict

import jrope
from configs import wikitext_cpu, wikitext_scaled_exact, wikitext_v2
from jrope.data import wikitext
from jrope.train.config import TrainConfig
from jrope.train.setup import set_up_run
from jrope.train.trainer import train_and_evaluate


def _tiny_text_config(tmp_path):
    return TrainConfig.from_config_dict(tiny_text_config_dict(tmp_path))


@pytest.mark.slow
def test_two_steps_on_a_text_file(tmp_path):
    cfg = _tiny_text_config(tmp_path)
    assert cfg.pe.name == "jordan_exact_scaled" and cfg.data.vocab_size == 257
    result = train_and_evaluate(cfg, str(tmp_path / "run"))
    rows = result["eval"]
    assert [row["length"] for row in rows] == [16, 32]
    for row in rows:
        # Two steps from a random start: the loss is finite and bits/byte is its base-2 twin.
        assert math.isfinite(row["loss"]) and row["loss"] > 0
        assert row["bits_per_byte"] == pytest.approx(row["loss"] / math.log(2.0))
    with open(tmp_path / "run" / "eval_step2" / "eval.csv", encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert [int(r["length"]) for r in written] == [16, 32]
    assert float(written[0]["loss"]) == pytest.approx(rows[0]["loss"], rel=1e-6)
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        steps = [json.loads(line)["step"] for line in f if "train/loss" in line]
    assert steps == [1, 2]


def test_wikitext103_config_without_data_stops_with_directions(tmp_path, monkeypatch):
    monkeypatch.setattr(wikitext, "archive_host_reachable", lambda: False)
    config = wikitext_scaled_exact.get_config()
    config.data.data_dir = str(tmp_path / "tfds")
    config.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(wikitext.DataUnavailable, match=r"wget -P .*tfds/downloads/manual"):
        set_up_run(TrainConfig.from_config_dict(config))


def test_paper_settings():
    v1 = TrainConfig.from_config_dict(wikitext_scaled_exact.get_config())
    assert (v1.model.d_model, v1.model.num_heads, v1.model.num_layers, v1.model.mlp_ratio) == (
        384,
        6,
        6,
        4,
    )
    assert (v1.data.seq_len, v1.batch_size, v1.num_steps) == (1024, 4, 1000)
    assert (v1.opt.learning_rate, v1.opt.weight_decay, v1.opt.clip_norm) == (3e-4, 0.1, 1.0)
    assert v1.eval.lengths == (1024, 2048, 4096, 8192) and v1.pe.name == "jordan_exact_scaled"
    v2 = TrainConfig.from_config_dict(wikitext_v2.get_config())
    assert (v2.model.d_model, v2.model.num_heads, v2.model.num_layers, v2.model.mlp_ratio) == (
        192,
        4,
        3,
        2,
    )
    assert (v2.data.seq_len, v2.pe.train_context, v2.batch_size, v2.num_steps) == (512, 512, 4, 500)
    assert (v2.opt.learning_rate, v2.opt.weight_decay, v2.data.train_fraction) == (5e-4, 0.05, 0.01)
    assert v2.eval.lengths[0] == 512 and v2.eval.lengths[-1] == 8192
    # The reference's v2 method list: every name parses, and it is the config's default's list.
    assert len(wikitext_v2.METHODS) == 12 and v2.pe.name in wikitext_v2.METHODS
    for method in wikitext_v2.METHODS:
        jrope.pe_config_from_name(method, train_context=512)
    for cfg in (v1, v2):
        assert cfg.data.source == "wikitext103" and cfg.data.vocab_size == 257
    cpu = TrainConfig.from_config_dict(wikitext_cpu.get_config())
    assert cpu.data.source == "wikitext2" and not cpu.data.path and not cpu.data.eval_path
    assert (cpu.data.train_split, cpu.data.eval_split) == ("train", "validation")
    assert np.all(np.diff(cpu.eval.lengths) > 0) and cpu.eval.lengths[-1] == 8 * cpu.data.seq_len
