"""The critic role: the value model (its engine is the trainer's, rlfabric.trainer.engine)."""
