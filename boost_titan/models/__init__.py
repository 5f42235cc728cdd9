from .args import ARCHITECTURES, LlamaArgs
from .flavors import FLAVORS, flavors_for

__all__ = ["ARCHITECTURES", "FLAVORS", "LlamaArgs", "flavors_for"]
