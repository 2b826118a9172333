"""Data sources of the trainer's data-source contract: the synthetic task and byte-level text.

Modules are imported where used (``jrope.data.synthetic``,
``jrope.data.text_bytes``); ``jrope.data.wikitext`` is also run as
``python -m jrope.data.wikitext --dataset=wikitext103|wikitext2`` to prepare
WikiText once, and ``jrope.data.audio`` as ``python -m jrope.data.audio`` to
turn a folder of WAVs (MusicNet) into byte-token files.
"""
