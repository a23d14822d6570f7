"""Chat templates that write tool calls in each format the gateway reads, written for these tests in the shapes
the model families' own templates use (tools declared in a system or user turn, each call in the assistant
turn, tool results in a turn of their own), over the tiny model's character-level tokenizer with the
family's special tokens added (so they are left out of a reply's text, as a real tokenizer leaves them).

    tokenizer = tokenizer_with("llama3_json")     # the tiny tokenizer, Llama 3's specials, a Llama-3.1-style template
"""

from __future__ import annotations

from rlfabric.quickstart.tiny_model import build_tokenizer

# Qwen2.5 / Hermes: tools in the system turn, each call a JSON object between <tool_call> tags.
HERMES = """\
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Qwen3-Coder: each call a <function=...> of <parameter=...> blocks, strings as written, other values as JSON.
QWEN3_XML = """\
{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name></function>
{%- endfor %}
Call one as <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{{- '\n<tool_call>\n<function=' + call.function.name + '>\n' }}
{%- for key, value in call.function.arguments.items() %}
{{- '<parameter=' + key + '>\n' }}{{ value if value is string else value | tojson }}{{ '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1 / 3.2: tools in the first user turn; a custom tool's call is the whole assistant turn, one JSON object.
LLAMA3_JSON = """\
<|begin_of_text|>
{%- for message in messages %}
{%- if message.role == "user" and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Answer with a function call as {"name": function name, "parameters": dictionary of argument name and value}.
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}

{{ message.content }}<|eot_id|>
{%- elif message.role == "assistant" and message.tool_calls %}
{%- for call in message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}<|eot_id|>
{%- endfor %}
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

TEMPLATES = {"hermes": HERMES, "qwen3_xml": QWEN3_XML, "llama3_json": LLAMA3_JSON}
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                   "<|python_tag|>"]


def tokenizer_with(tool_call_format: str):
    """The tiny model's tokenizer with the template that writes `tool_call_format`'s calls (and its specials)."""
    tokenizer = build_tokenizer()
    if tool_call_format == "llama3_json":
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tokenizer.chat_template = TEMPLATES[tool_call_format]
    return tokenizer
