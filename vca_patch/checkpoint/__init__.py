"""Saving, loading and building models."""

from vca_patch.checkpoint.base_model import HubUnavailableError, UnknownModelError, load_base_model
from vca_patch.checkpoint.folder import CheckpointError, from_pretrained, read_checkpoint_config, save_pretrained
from vca_patch.core.atomic import OutputExistsError
from vca_patch.core.weights import WeightsMismatchError

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
