"""gateway: the OpenAI-compatible endpoint existing agent code calls (docs/agents-gateway.md).

    gateway = Gateway(config, tokenizer, RouterGenerator(router))     # or any TokenGenerator
    await gateway.start()                                             # uvicorn on loopback, in this process
    episode = gateway.episodes.open()                                 # the agent's OPENAI_API_KEY: episode.key
    ...                                                               # the agent calls gateway.base_url
    record = gateway.episodes.close(episode.key)                      # its calls, joined into segments

It renders the agent's messages with the model's chat template, generates from token ids through the rollout
router (any engine), and records each call's prompt ids, sampled ids, log-probs and weight versions; a call
that extends an earlier one reuses that call's ids verbatim (never re-encoded).
"""
