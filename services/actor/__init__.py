"""The actor, reference and critic services: PPO training and scoring of the policy and value models.

One implementation serves the three roles (`rlfabric serve actor|reference|critic`), layered along the
process boundaries:

    service.py     gRPC servicers (proto <-> tensors) and build_service(role, config)
    client.py      the three roles' interfaces (tensors in, tensors out) and their gRPC clients
    engine.py      TrainerEngine: rank 0; validates, shards requests over the ranks, runs them on one thread
    dist.py        the data-parallel group: starting ranks 1..N-1, commands as tensors over gloo/NCCL
    worker.py      RankWorker: one rank's model (FSDP2), optimizer and per-rank compute
    objectives.py  forward passes and the PPO policy / value losses of one micro-batch
    batch.py       the batch layout, its validation, micro-batching and padding removal
    models.py      loading models from a Hugging Face directory; FSDP2 sharding
    checkpoint.py  checkpoints and Hugging Face exports, written atomically
    tiny_model.py  the tiny random Qwen2 used by tests and the quickstart
"""
