"""The actor service (PPO training of the policy) over the shared trainer (rlfabric.trainer):

    servicer.py    ActorService (proto <-> tensors) and build_service; build_trainer_service for all three roles
    client.py      ActorInterface, its gRPC and in-process clients, and what the three roles' clients share
"""
