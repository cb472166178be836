"""Saving, loading and building models."""

from .atomic import OutputExistsError
from .base_model import HubUnavailableError, UnknownModelError, load_base_model
from .checkpoint import CheckpointError, from_pretrained, read_checkpoint_config, save_pretrained
from .weights import WeightsMismatchError

__all__ = [
    "CheckpointError",
    "HubUnavailableError",
    "OutputExistsError",
    "UnknownModelError",
    "WeightsMismatchError",
    "from_pretrained",
    "load_base_model",
    "read_checkpoint_config",
    "save_pretrained",
]
