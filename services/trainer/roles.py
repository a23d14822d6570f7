"""What makes the actor, the reference and the critic different, said once.

The trainer package is one engine for three roles. Everything that differs between them is a field of
their RoleSpec, chosen once from the role's name (`role_spec`); the engine, the rank worker and the model
loader read the fields and never the name.

| role      | head   | trainable | weights  | objective         |
|-----------|--------|-----------|----------|-------------------|
| actor     | policy | yes       | sends    | PolicyObjective   |
| reference | policy | no        | receives | (none)            |
| critic    | value  | yes       | neither  | ValueObjective    |
| teacher   | policy | no        | neither  | (none)            |

The teacher (on-policy distillation) is a reference of another model: teacher.model_path, never synced.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfabric.core.config import RunConfig


@dataclass(frozen=True)
class RoleSpec:
    name: str
    value_head: bool  # a scalar per position (AutoModelForTokenClassification), else the policy's log-probs
    trainable: bool  # takes updates: an optimizer, float32 master weights, mini-batches
    sends_weights: bool  # the actor: its weights go to the rollout and the reference
    receives_weights: bool  # the reference: it serves the actor's weights after a sync
    takes_lora: bool  # actor.lora applies to this role's model
    has_own_model_path: bool  # critic.model_path (teacher.model_path) may name another model than model.path

    @property
    def trains_policy(self) -> bool:
        """The actor: PPO's policy objective, a loss_mode, plugin losses, old log-probs."""
        return self.trainable and not self.value_head

    def section(self, config: RunConfig):
        """The role's config section (config.actor, config.reference, config.critic or config.teacher)."""
        return getattr(config, self.name)

    def model_path(self, config: RunConfig) -> str:
        """The directory the role loads: model.path, or the role's own <role>.model_path when set."""
        if self.has_own_model_path and self.section(config).model_path:
            return self.section(config).model_path
        if not config.model.path:
            raise ValueError(f"{self.name}: model.path is empty; point it at a local Hugging Face model directory")
        return config.model.path

    def outputs(self, with_entropy: bool, with_sum_pi_squared: bool = False) -> list[str]:
        """The per-token tensors a forward pass returns."""
        if self.value_head:
            return ["values"]
        return ["log_probs"] + (["entropy"] if with_entropy else []) + (["sum_pi_squared"] if with_sum_pi_squared else [])

    def forward_micro_rows(self, config: RunConfig) -> int:
        """Rows per micro-batch of a forward pass (VeRL's names differ for the value model)."""
        section = self.section(config)
        return (section.forward_micro_batch_size_per_gpu if self.value_head
                else section.log_prob_micro_batch_size_per_gpu)


ROLES = {
    "actor": RoleSpec("actor", value_head=False, trainable=True, sends_weights=True, receives_weights=False,
                      takes_lora=True, has_own_model_path=False),
    "reference": RoleSpec("reference", value_head=False, trainable=False, sends_weights=False,
                          receives_weights=True, takes_lora=False, has_own_model_path=False),
    "critic": RoleSpec("critic", value_head=True, trainable=True, sends_weights=False, receives_weights=False,
                       takes_lora=False, has_own_model_path=True),
    "teacher": RoleSpec("teacher", value_head=False, trainable=False, sends_weights=False, receives_weights=False,
                        takes_lora=False, has_own_model_path=True),
}
TRAINER_ROLES = tuple(ROLES)


def role_spec(role: str) -> RoleSpec:
    """The spec of "actor", "reference", "critic" or "teacher"; ValueError naming them otherwise."""
    try:
        return ROLES[role]
    except KeyError:
        raise ValueError(f"{role!r} is not a trainer role; the trainer serves {', '.join(ROLES)}") from None
