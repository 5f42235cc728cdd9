"""boost_titan: bottleneck-aware tensor parallelism for low-rank LLaMA on torchtitan.

Importing the package stays light (no torchtitan import): ``boost_titan.train`` must
activate CPU support before torchtitan loads. Train specs register on
``import boost_titan.specs``.
"""

__version__ = "0.1.0"
