"""data.pack: byte-level training windows cut into articles, trained on as separate sequences."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_config import tiny_text_config_dict

from jrope.data.text_bytes import ByteTextSource, TextDataConfig, decode_tokens
from jrope.errors import ConfigError
from jrope.losses import weighted_sums
from jrope.train import setup
from jrope.train.config import TrainConfig
from jrope.train.evaluation import EvalStep
from jrope.train.setup import model_from_params, set_up_run
from jrope.train.trainer import make_train_step

LENGTH = 48
# Articles of about 60 bytes, with a section heading (" = = ... = = ") that must not cut one.
ARTICLES = "".join(
    f" = Article {i} = \n Text of {i} .\n = = Part = = \n More {'x' * (i % 7)} .\n"
    for i in range(40)
)
# A byte that opens an article's title: the line before ended, " = " and no second "=".
TITLE = re.compile(r"(?<=\n) = (?!=)")


def _source(tmp_path, pack=True):
    path = tmp_path / "articles.txt"
    path.write_text(ARTICLES, encoding="utf-8")
    cfg = TextDataConfig(
        source="text",
        path=str(path),
        eval_path=str(path),
        seq_len=LENGTH,
        cache_dir=str(tmp_path / "cache"),
        pack=pack,
    )
    return ByteTextSource(cfg, 8, 0, 1)


def test_packed_windows_are_cut_at_article_titles_only(tmp_path):
    packed, whole = _source(tmp_path), _source(tmp_path, pack=False)
    cuts = 0
    for step in range(3):
        batch, unpacked = packed.train_batch(step), whole.train_batch(step)
        assert set(batch) == {"inputs", "targets", "weights", "positions", "segment_ids"}
        for key in unpacked:  # the same bytes, only cut
            np.testing.assert_array_equal(batch[key], unpacked[key])
        assert batch["positions"].dtype == batch["segment_ids"].dtype == np.int32
        for inputs, positions, segment_ids in zip(
            batch["inputs"], batch["positions"], batch["segment_ids"], strict=True
        ):
            starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))
            np.testing.assert_array_equal(segment_ids[starts], np.arange(len(starts)))
            text = decode_tokens(inputs, 257)
            assert text.isascii()  # one character per byte: string offsets are token indices
            # A segment starts at the window's first byte and at every title within it.
            titles = [m.start() for m in TITLE.finditer(text)]
            assert list(starts[1:]) == titles
            for first, end in zip(starts, [*starts[1:], LENGTH], strict=True):
                np.testing.assert_array_equal(positions[first:end], np.arange(end - first))
            cuts += len(starts) - 1
    assert cuts >= 3  # the windows do cross articles


def test_pack_is_refused_where_it_cannot_apply(tmp_path):
    config = tiny_text_config_dict(tmp_path)
    config.data.pack = True
    config.model.attention_impl = "splash"
    with pytest.raises(ConfigError, match="data.pack needs model.attention_impl in "):
        TrainConfig.from_config_dict(config)
    config = tiny_text_config_dict(tmp_path)
    config.data.pack = True
    config.data.source = "audio_tokens"
    with pytest.raises(ConfigError, match="data.pack = True has no effect"):
        TrainConfig.from_config_dict(config)


@pytest.mark.slow
def test_packed_losses_equal_the_losses_of_the_articles_alone(tmp_path):
    """The train and evaluation steps' losses on a packed batch, against each article in a row
    of its own.

    Both sum the same per-token cross-entropies in float32, computed from
    logits that agree to a few roundings (tests/test_packed_model.py); the
    means differ by float32 summation order: rtol 1e-5.
    """
    config = tiny_text_config_dict(tmp_path)
    (tmp_path / "corpus.txt").write_text(ARTICLES, encoding="utf-8")
    config.data.pack = True
    config.pe.train_context = LENGTH
    cfg = TrainConfig.from_config_dict(config)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    params = jax.device_get(state["params"])  # the step donates the state
    batch = run.source.train_batch(0)
    with jax.set_mesh(run.mesh):
        _, metrics = make_train_step(run)(
            state, setup.global_batch(batch, cfg.mesh.rules, run.mesh)
        )
    # Each article alone at positions 0, 1, ... of a row of its own, padded at its end (causal:
    # the padding changes no logit of the article) and weighted on the article's tokens only.
    rows = [
        (row, batch["segment_ids"][row] == segment)
        for row in range(len(batch["inputs"]))
        for segment in np.unique(batch["segment_ids"][row])
    ]
    alone = {
        key: np.zeros((len(rows), LENGTH), batch[key].dtype)
        for key in ("inputs", "targets", "weights")
    }
    for index, (row, tokens) in enumerate(rows):
        for key in alone:
            alone[key][index, : tokens.sum()] = batch[key][row][tokens]
    model = model_from_params(run.layout.graphdef, params)
    logits = model(jnp.asarray(alone["inputs"]), jnp.arange(LENGTH, dtype=jnp.int32))
    sums = weighted_sums(logits, jnp.asarray(alone["targets"]), jnp.asarray(alone["weights"]), None)
    assert float(sums["weight_sum"]) == batch["weights"].sum()
    assert len(np.unique(batch["segment_ids"])) > 1  # some window holds two articles
    expected = float(sums["loss_sum"]) / float(sums["weight_sum"])
    assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
    with jax.set_mesh(run.mesh):  # the evaluation step reads a packed batch alike
        evaluated = EvalStep(run)(params, setup.global_batch(batch, cfg.mesh.rules, run.mesh))
    assert float(evaluated["loss_sum"]) == pytest.approx(float(sums["loss_sum"]), rel=1e-5)
