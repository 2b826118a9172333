"""The package as a user meets it: its version, and the names dir() and help() show."""

import pydoc
import re

import jrope


def test_the_version_is_a_release_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+", jrope.__version__)


def test_dir_and_help_list_every_exported_name_the_lazy_ones_too():
    names = dir(jrope)
    assert "importlib" not in names  # the namespace holds the package's own names
    for name in jrope.__all__:
        assert name in names
        assert getattr(jrope, name) is not None
    text = pydoc.render_doc(jrope, renderer=pydoc.plaintext)
    for lazy in ("PositionalEncoding", "dot_product_attention", "causal_self_attention"):
        assert re.search(rf"^    (class )?{lazy}\b", text, re.MULTILINE), lazy
