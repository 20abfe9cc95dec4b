"""Single-device models built as flat ``nn.Sequential`` containers of named blocks.

No parallelism and no Lightning here: strategies split or shard these models from the outside.
"""

from lightning_parallel.models.resnet import ResNet
from lightning_parallel.models.simple_cnn import SimpleCNN
from lightning_parallel.models.transformer import GPT

__all__ = ["GPT", "ResNet", "SimpleCNN"]
