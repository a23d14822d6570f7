"""rlfabric: a gRPC microservice mesh for disaggregated RL post-training of LLMs."""

__version__ = "0.1.0"
