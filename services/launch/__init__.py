"""Launchers: the local mesh (`rlfabric up`/`train`: local.py) and the Ray one (ray.py)."""
