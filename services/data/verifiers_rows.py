"""Run by the verifiers venv's interpreter, not imported (rlfabric.data.verifiers): prints a verifiers 0.4 task
set's tasks as JSON lines, {"index", "messages"}: the task's position in load() and the messages its chat
harness opens with (the system prompt, then the prompt). Nothing else of the task: its other fields are what
verifiers scores with.

    python verifiers_rows.py TASKSET_ID START STOP [PATH ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    taskset_id, start, stop, *path = sys.argv[1:]
    sys.path[:0] = path
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.utils.loaders import load_taskset

    taskset = load_taskset(vf.TasksetConfig(id=taskset_id))
    view = taskset.include(idx=[f"{start}:{stop}"]) if int(stop) else taskset.skip(int(start))
    for task in view:
        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            messages += [message_to_wire(message) for message in data.prompt]
        print(json.dumps({"index": data.idx, "messages": messages}))


if __name__ == "__main__":
    main()
