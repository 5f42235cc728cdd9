"""The models, independent of any parallelism: dense LLaMA-2 and its low-rank twins.

args        LlamaArgs: shapes, ranks and the [boost] model options; validation
flavors     the sizes of every architecture (debugmodel ... 34b) and their ranks
model       the Transformer: dense and low-rank blocks (chunk bodies BTP moves)
bottleneck  the bottleneck layer W ~= B act(A x), LaX's latent crossing, and the
            LatentComm hooks every TP plan fills in
"""

from .args import ARCHITECTURES, LlamaArgs
from .flavors import FLAVORS, flavors_for

__all__ = ["ARCHITECTURES", "FLAVORS", "LlamaArgs", "flavors_for"]
