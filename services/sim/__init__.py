"""The simulation's models, shared by the simulated rollout engine (rlfabric.rollout.sim_engine) and the simulated
trainer (rlfabric.trainer.sim_engine): how long generation, updates and weight syncs take, how long responses are,
and the tiny real payload a simulated weight sync carries (docs/simulation.md)."""
