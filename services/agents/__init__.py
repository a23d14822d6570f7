"""agents: the user's agent code, run once per episode against the gateway (docs/agents-gateway.md).

    runner = runner_of(config.agent)                 # inline, subprocess or command (agent.runner)
    outcome = await runner.run(task, LLM(base_url, api_key, model))   # a reward, an answer, metrics

The agent is `async def run(task, llm)` (agent.entrypoint) or any program (agent.command). It never sees the
ground truth: `task` holds the prompt messages and the row's public fields. What it returns is read by
`outcome.parse_outcome`; anything else is an AgentFailed, which the coordinator masks and counts.
"""
