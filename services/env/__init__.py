"""Environments for multi-turn rollouts: the EnvironmentService's domain (sessions of an environment a
model acts in with tool calls), the built-in environments and the registry that names them.

Built in: calculator (arithmetic), python (code run in the reward sandbox's confinement) and lookup
(a toy task whose answer only a tool call gives). More come from modules that call
register_environment (env.environment_modules).
"""

from rlfabric.env.calculator import CalculatorEnvironment
from rlfabric.env.environment import (
    Environment,
    Tool,
    ToolEnvironment,
    ToolError,
    ToolTimeout,
    environment_factory,
    register_environment,
    registered_environments,
)
from rlfabric.env.lookup import LookupEnvironment
from rlfabric.env.python_tool import PythonEnvironment

register_environment("calculator", CalculatorEnvironment)
register_environment("python", PythonEnvironment)
register_environment("lookup", LookupEnvironment)

__all__ = [
    "CalculatorEnvironment",
    "Environment",
    "LookupEnvironment",
    "PythonEnvironment",
    "Tool",
    "ToolEnvironment",
    "ToolError",
    "ToolTimeout",
    "environment_factory",
    "register_environment",
    "registered_environments",
]
