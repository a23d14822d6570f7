"""The reference role: the frozen reference policy (its engine is the trainer's, rlfabric.trainer.engine), and
the teacher role of on-policy distillation, a reference of another model (teacher.py)."""
