"""The reference role: the frozen reference policy (its engine is the trainer's, rlfabric.trainer.engine)."""
