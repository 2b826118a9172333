"""Data sources of the trainer's data-source contract (``jrope.data.source``): the synthetic
task, byte-level text, signal regression and key-value retrieval.

Modules are imported where used (``jrope.data.synthetic``, ``jrope.data.text_bytes``,
``jrope.data.signal``, ``jrope.data.retrieval``); ``jrope.data.wikitext`` is also run as
``python -m jrope.data.wikitext --dataset=wikitext103|wikitext2`` to prepare
WikiText once, and ``jrope.data.audio`` as ``python -m jrope.data.audio`` to
turn a folder of WAVs (MusicNet) into byte-token files.
"""
