"""The two shapes of user reward function the custom pool calls (reward.custom_signature).

    verl  fn(data_source, solution_str, ground_truth, extra_info, **custom_kwargs) -> float | dict
          VeRL's custom_reward_function; a dict's "score" is the reward, its other numbers metrics.
    trl   fn(prompts, completions, **columns, **custom_kwargs) -> list[float]
          TRL's reward functions (GRPOTrainer(reward_funcs=...)): every argument a list, one entry per
          completion. columns are ground_truth, data_source and each key of the row's extra_info (the
          columns of `rlfabric data custom` keep their names there), as TRL passes a data set's columns.
          Prompts and completions are text; TRL's completion_ids and trainer_state are not passed (a
          function that needs them fails its load).

The style is a config key, not guessed from the function: the service never imports the user's file
(only the sandboxed worker does), a `def f(*args, **kwargs)` fits both, and a key shows in the
config and in `rlfabric config-reference`. The worker still reads the signature once it has loaded the
function, so a function of the other style fails the load with a message that names the key.

A trl function is called once per completion (lists of one): each completion keeps its own timeout
and failure, as a compute_score call does, and the pool's workers score a batch in parallel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

SIGNATURES = ("verl", "trl")

# Parameter names that only the other style's functions take.
_TRL_NAMES = {"prompts", "completions", "completion_ids"}
_VERL_NAMES = {"data_source", "solution_str", "ground_truth", "extra_info"}
# What TRL passes and rlfabric does not: the completions' token ids, and the trainer's state.
_TRL_NOT_PASSED = ("completion_ids", "trainer_state")


class SignatureMismatch(TypeError):
    """The user's function does not take the arguments reward.custom_signature says it is called with."""


def check_signature(fn: Callable[..., Any], signature: str, name: str) -> None:
    """SignatureMismatch when fn's parameters show it was written for the other style."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to read, its call will tell
        return
    names = set(parameters)
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if signature == "verl" and names & {"prompts", "completions"} and not names & _VERL_NAMES:
        raise SignatureMismatch(
            f"{name}{inspect.signature(fn)} takes TRL's arguments (prompts, completions, ...); "
            "set reward.custom_signature: trl")
    if signature == "trl" and "completions" not in names and not takes_any_keyword:
        hint = "; set reward.custom_signature: verl" if names & _VERL_NAMES else ""
        raise SignatureMismatch(
            f"{name}{inspect.signature(fn)} has no 'completions' parameter (nor **kwargs), which "
            f"reward.custom_signature: trl passes{hint}")
    required = [key for key in _TRL_NOT_PASSED if key in parameters
                and parameters[key].default is inspect.Parameter.empty
                and parameters[key].kind is not inspect.Parameter.VAR_KEYWORD]
    if signature == "trl" and required:
        raise SignatureMismatch(f"{name} needs {', '.join(required)}, which rlfabric does not pass (TRL does): "
                                "give it a default or take it through **kwargs")


def caller(fn: Callable[..., Any], signature: str, kwargs: dict[str, Any]) -> Callable[[dict], Any]:
    """A function scoring one request (data_source, solution_str, ground_truth, extra_info, prompt) with fn
    called in `signature`'s style; it returns what fn returned (a trl function's one score)."""
    if signature == "verl":
        def call_verl(item: dict) -> Any:
            return fn(item["data_source"], item["solution_str"], item["ground_truth"], item["extra_info"], **kwargs)

        return call_verl
    if signature != "trl":
        raise ValueError(f"reward.custom_signature must be one of {SIGNATURES}, got {signature!r}")

    def call_trl(item: dict) -> Any:
        columns = {key: [value] for key, value in (item["extra_info"] or {}).items() if key not in _TRL_NAMES}
        columns.update(ground_truth=[item["ground_truth"]], data_source=[item["data_source"]])
        scores = fn(prompts=[item["prompt"]], completions=[item["solution_str"]], **columns, **kwargs)
        if not isinstance(scores, (list, tuple)) or len(scores) != 1:
            got = f"{len(scores)} values" if isinstance(scores, (list, tuple)) else f"a {type(scores).__name__}"
            raise TypeError(f"a trl reward function returns a list with one score per completion; it was "
                            f"given 1 completion and returned {got}")
        if scores[0] is None:
            raise TypeError("the function returned None for this completion (TRL: not applicable); "
                            "rlfabric needs a number")
        return scores[0]

    return call_trl
