"""The quickstart: the tiny model, its warm start, the synthetic task and its config (quickstart.yaml)."""
