"""Launchers: the local mesh (`rlfabric up`/`train`: local.py), the Ray one (ray.py) and the in-process one (`train --in-process`: inprocess.py)."""
