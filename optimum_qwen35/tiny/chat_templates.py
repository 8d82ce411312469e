"""Chat templates of the newest checkpoints of this architecture, for tiny checkpoints in their shape.

Qwen3.6 (27B, 35B-A3B) and Qwen3.8 (27B) keep Qwen3.5's model (`model_type` qwen3_5 / qwen3_5_moe,
`Qwen3_5ForConditionalGeneration`) and change the chat template. What each template does, as written here (our own
Jinja, written from the published behaviour; no weights or files of those checkpoints are on this machine):

- both: ChatML turns; tools in the system turn (`# Tools ... <tools>` one JSON object per line `</tools>` and the
  XML call format); an assistant's tool calls as `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n
  </function>\\n</tool_call>`; tool results folded into one user turn of `<tool_response>` blocks; an assistant's
  `reasoning_content` inside `<think>\\n...\\n</think>\\n\\n`; the generation prompt opens `<think>\\n` (thinking on,
  the default) or pre-fills an empty `<think>\\n\\n</think>\\n\\n` (`enable_thinking=False`).
- Qwen3.6 adds `preserve_thinking` (default false): false drops the reasoning of assistant turns before the last
  user query, true keeps it (Qwen3.6 model card, "Thinking Preservation").
- Qwen3.8 turns `preserve_thinking` on by default and adds `reasoning_effort` ("xhigh" default, "medium", "low"):
  with thinking on, "xhigh" and "low" put an instruction at the top of the system turn, "medium" none; an
  assistant's `<think>` markup inside `content` stays content.

Sources (recorded in docs/model.md, "Newest checkpoints"): the Qwen3.6-27B model card (layout and the
preserve_thinking option), and xtuner's Qwen3.8 rendering parity tests against the pinned Qwen/Qwen3.8-27B template
(revision 1d4bf0f2ff6012fd82039f2fa52739d0dd7c60c0): the reasoning-effort instruction texts, the defaults, the tool
format.
"""

from __future__ import annotations

XHIGH_REASONING = (
    "Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, consider "
    "plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer."
)
LOW_REASONING = (
    "Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion without "
    "unnecessary elaboration."
)
TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_FOOTER = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call>"
)


def _jinja_string(text: str) -> str:
    """A Python string as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _template(preserve_default: bool, reasoning_effort: bool) -> str:
    """One template; `preserve_default`: preserve_thinking when not given; `reasoning_effort`: Qwen3.8's option."""
    effort = (
        "{%- set effort = reasoning_effort if reasoning_effort is defined else 'xhigh' -%}"
        "{%- if effort not in ['xhigh', 'medium', 'low'] -%}"
        "{{- raise_exception('reasoning_effort must be xhigh, medium or low') -}}{%- endif -%}"
        "{%- if thinking and effort == 'xhigh' -%}{%- set instruction = " + _jinja_string(XHIGH_REASONING) + " -%}"
        "{%- elif thinking and effort == 'low' -%}{%- set instruction = " + _jinja_string(LOW_REASONING) + " -%}"
        "{%- endif -%}"
    ) if reasoning_effort else ""
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- elif content is none -%}"
        "{%- else -%}{%- for part in content -%}"
        "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
        "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
        "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
        "{%- set thinking = not (enable_thinking is defined and enable_thinking is false) -%}"
        "{%- set preserve = preserve_thinking if preserve_thinking is defined else " + str(preserve_default).lower() + " -%}"
        "{%- set instruction = '' -%}"
        + effort +
        "{%- set system = render(messages[0]['content']) | trim if messages[0]['role'] == 'system' else '' -%}"
        "{%- if tools -%}"
        "{{- '<|im_start|>system\\n' -}}{%- if instruction -%}{{- instruction + '\\n\\n' -}}{%- endif -%}"
        "{{- " + _jinja_string(TOOLS_HEADER) + " -}}"
        "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
        "{{- " + _jinja_string(TOOLS_FOOTER) + " -}}"
        "{%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}{{- '<|im_end|>\\n' -}}"
        "{%- elif system or instruction -%}"
        "{{- '<|im_start|>system\\n' + instruction + ('\\n\\n' if instruction and system else '') + system + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        # The last user turn that is a query, not tool results: reasoning after it is always shown.
        "{%- set last = namespace(index=-1) -%}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}{%- set text = render(message['content']) | trim -%}"
        "{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}"
        "{%- set last.index = loop.index0 -%}{%- endif -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for message in messages -%}"
        "{%- set content = render(message['content']) | trim -%}"
        "{%- if message['role'] == 'system' -%}"
        "{%- if not loop.first -%}{{- raise_exception('System message must be at the beginning.') -}}{%- endif -%}"
        "{%- elif message['role'] == 'user' -%}"
        "{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' -}}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if preserve or loop.index0 > last.index -%}"
        "{%- set reasoning = (message['reasoning_content'] | trim) if message['reasoning_content'] is string else '' -%}"
        "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' if reasoning else '<think>\\n\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{{- content -}}"
        "{%- for call in message['tool_calls'] or [] -%}"
        "{%- set call = call['function'] if call['function'] is defined else call -%}"
        "{{- ('\\n\\n' if content else '') if loop.first else '\\n' -}}"
        "{{- '<tool_call>\\n<function=' + call['name'] + '>\\n' -}}"
        "{%- set arguments = call['arguments'] -%}"
        "{%- if arguments is defined and arguments is not none and arguments is not mapping and arguments != '' -%}"
        "{{- raise_exception('tool call arguments must be a mapping (a dict), not a JSON string') -}}{%- endif -%}"
        "{%- if arguments is mapping -%}{%- for name, value in arguments.items() -%}"
        "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}"
        "{%- endfor -%}{%- endif -%}"
        "{{- '</function>\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
        "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- else -%}{{- raise_exception('Unexpected message role.') -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|im_start|>assistant\\n' + ('<think>\\n' if thinking else '<think>\\n\\n</think>\\n\\n') -}}"
        "{%- endif -%}"
    )


# The chat template of each checkpoint family a tiny checkpoint can be built in (`build_tiny_checkpoint(family=)`);
# "qwen3.5" is the tokenizer module's own CHAT_TEMPLATE.
CHAT_TEMPLATES = {
    "qwen3.6": _template(preserve_default=False, reasoning_effort=False),
    "qwen3.8": _template(preserve_default=True, reasoning_effort=True),
}
