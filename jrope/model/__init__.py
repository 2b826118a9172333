"""The decoder-only Transformer, its configuration and its logical axis names."""

from jrope.model.config import ModelConfig
from jrope.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
