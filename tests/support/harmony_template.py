"""A chat template rendering the harmony format (gpt-oss), written for tests from the format's published description:
a system message naming the channels, a developer message with the instructions and the tools as a `functions`
namespace, user turns, the assistant's past answers (`final`) and calls (`commentary to=functions.NAME`), tool results
(`functions.NAME to=assistant`), and `<|start|>assistant` as the generation prompt. gpt-oss's own template renders the
same messages (with TypeScript parameter types where this one writes the JSON schema)."""

from __future__ import annotations

# transformers renders with trim_blocks: a newline right after a tag is dropped, so line breaks are written as "\n".
HARMONY_TEMPLATE = """\
{%- set ns = namespace(instructions="", last_call="") -%}
{%- for m in messages if m.role in ("system", "developer") -%}
{%- set ns.instructions = ns.instructions + m.content -%}
{%- endfor -%}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.{{ "\n" }}
{{- "Knowledge cutoff: 2024-06\n\n" }}
{{- "Reasoning: " + (reasoning_effort | default("medium")) + "\n\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif -%}
<|end|>
{%- if ns.instructions or tools -%}
<|start|>developer<|message|>
{%- if ns.instructions %}{{ "# Instructions\n\n" + ns.instructions }}{% endif -%}
{%- if ns.instructions and tools %}{{ "\n\n" }}{% endif -%}
{%- if tools -%}
{{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" }}
{%- for t in tools -%}
{{- "// " + (t.function.description | default("")) + "\n" }}
{{- "type " + t.function.name + " = (_: " + (t.function.parameters | default({}) | tojson) + ") => any;\n\n" }}
{%- endfor -%}
{{- "} // namespace functions" }}
{%- endif -%}
<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == "user" -%}
<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" and m.tool_calls -%}
{%- for c in m.tool_calls -%}
{%- set ns.last_call = c.function.name -%}
<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>
{{- c.function.arguments | tojson }}<|call|>
{%- endfor -%}
{%- elif m.role == "assistant" -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == "tool" -%}
<|start|>functions.{{ ns.last_call }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""
