"""Chat prompts: the GGUF's Jinja chat template (as transformers renders it), Ollama's Go-template
TEMPLATE syntax, end-of-generation stops, and tool calls parsed out of generated text.

Pure Python; the scheduler and the API build prompts with these.
"""

from ollama_engine.template.gojson import go_json
from ollama_engine.template.goparse import TemplateError
from ollama_engine.template.gotemplate import DEFAULT_TEMPLATE, GoTemplate, collate
from ollama_engine.template.gotemplate import parse as parse_go_template
from ollama_engine.template.jinja import ChatTemplate, ChatTemplateError, strip_bos, template_capabilities
from ollama_engine.template.stops import end_of_generation, stop_words
from ollama_engine.template.toolcalls import ToolCallStream, parse_tool_calls

__all__ = [
    "DEFAULT_TEMPLATE", "ChatTemplate", "ChatTemplateError", "GoTemplate", "TemplateError", "ToolCallStream",
    "collate", "end_of_generation", "go_json", "parse_go_template", "parse_tool_calls", "stop_words",
    "strip_bos", "template_capabilities",
]
