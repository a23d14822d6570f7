"""config_reference: every key of the run config with its default and meaning (`rlfabric config-reference`,
docs/config-reference.md, and the keys a did-you-mean picks from)."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from rlfabric.core.config.run import RunConfig


def config_reference(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field, for docs and `rlfabric config-reference`."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        value_type = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(config_reference(annotation, key + "."))
        elif isinstance(value_type, type) and issubclass(value_type, BaseModel):  # resource_pools.<name>.gpus
            rows.append((key, repr(field.default), field.description or ""))
            rows.extend(config_reference(value_type, key + ".<name>."))
        else:
            rows.append((key, repr(field.default), field.description or ""))
    return rows
