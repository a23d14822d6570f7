"""The sandbox that user code runs in: the custom reward functions (rlfabric.reward.custom_worker) and the
environment's python tool (rlfabric.env.python_runner) both run confined by it (docs/sandbox.md).

- confine: the confinement itself (own uid, network namespace, limits, private /tmp, its environment)
- process_tree: the processes a sandbox leaves (a subreaper's cleanup, the memory bound over the tree)
- imports: the installed modules user code names, imported before the privileges drop
"""
