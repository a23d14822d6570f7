"""What every section shares: the base class (unknown keys are errors, field docstrings are the docs), the config error."""

from __future__ import annotations

import re
import reprlib

from pydantic import (
    BaseModel,
    ConfigDict,
)

# Policy loss modes whose own loss aggregation differs from actor.loss_agg_mode's default, token-mean.
LOSS_MODE_AGGREGATION = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
DEFAULT_CONFIG_NAME = "quickstart.yaml"
_DOTTED_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
# Messages quote inputs through this: an input of megabytes (a value, an override) shows as its start.
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 200
_QUOTE.maxlist = _QUOTE.maxdict = 10
_QUOTE.maxlevel = 3


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the dotted key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
