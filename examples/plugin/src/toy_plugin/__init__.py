"""A toy vca-patch plug-in (docs/extending.md): the target `temp-softmax` and the model family `toy-vit`.

Nothing here needs importing by hand: installed, vca-patch finds both through the entry points in pyproject.toml."""

from toy_plugin.family import ToyViT, ToyViTAdapter
from toy_plugin.target import TempSoftmaxAttention, TempSoftmaxConfig, TempSoftmaxHandler

__all__ = ["TempSoftmaxAttention", "TempSoftmaxConfig", "TempSoftmaxHandler", "ToyViT", "ToyViTAdapter"]
