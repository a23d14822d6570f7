"""rlfabric: a gRPC microservice mesh for disaggregated RL post-training of LLMs.

    import rlfabric
    result = rlfabric.train(overrides=["trainer.total_steps=20"])    # rlfabric.api.train
    async with rlfabric.connect(result.run_dir) as mesh: ...          # a running mesh's clients
"""

from rlfabric.api import TrainResult, connect, train

__version__ = "0.1.0"
__all__ = ["TrainResult", "connect", "train", "__version__"]
