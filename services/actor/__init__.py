"""The actor service (PPO training of the policy) and the trainer engine the three model roles share:
the reference (rlfabric.reference) and the critic (rlfabric.critic) run the same engine with their own
servicer and client. Layered along the process boundaries:

    servicer.py    ActorService (proto <-> tensors) and build_service; build_trainer_service for all three
    client.py      ActorInterface, its gRPC and in-process clients, and what the three roles' clients share
    engine.py      TrainerEngine: rank 0; validates, shards requests over the ranks, runs them on one thread
    dist.py        the data-parallel group: starting ranks 1..N-1, commands as tensors over gloo/NCCL
    worker.py      RankWorker: one rank's model (FSDP2), optimizer and per-rank compute
    objectives.py  forward passes and the PPO policy / value losses of one micro-batch
    batch.py       the batch layout, its validation, micro-batching and padding removal
    models.py      loading models from a Hugging Face directory; FSDP2 sharding
    lora.py        LoRA adapters (peft) for the actor
    checkpoint.py  checkpoints and Hugging Face exports, written atomically
"""
