"""sclaro-jax: JAX/Flax NNX ScenarioCLIP training and MINER retrieval.

Packages, in the order data flows: `data` (tokenizer, input pipeline) -> `models` (CLIP towers)
-> losses -> train -> eval, with miner beside eval. This package never imports torch.
"""

__version__ = "0.1.0"
