"""Chat prompts: Ollama's Go templates (against Ollama's own expected outputs), the GGUF Jinja template
rendered as transformers does (the real SmolLM2 template), stop tokens and tool-call parsing."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import pytest

from ollama_engine.template import (
    ChatTemplate,
    ChatTemplateError,
    GoTemplate,
    TemplateError,
    ToolCallStream,
    collate,
    end_of_generation,
    go_json,
    parse_go_template,
    parse_tool_calls,
    stop_words,
    strip_bos,
    template_capabilities,
)
from ollama_engine.template.gojson import Float32, GoStruct
from ollama_engine.tokenizer import Vocabulary

TEMPLATES = Path(__file__).parent / "data" / "ollama_templates"

# The three conversations of Ollama's TestTemplate (template/template_test.go), keyed as its testdata files.
_USER = {"role": "user", "content": "Hello, how are you?"}
_ASSISTANT = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
_USER2 = {"role": "user", "content": "I'd like to show off how chat templating works!"}
CONVERSATIONS = {
    "user": [_USER],
    "user-assistant-user": [_USER, _ASSISTANT, _USER2],
    "system-user-assistant-user": [{"role": "system", "content": "You are a helpful assistant."}, _USER, _ASSISTANT,
                                   _USER2],
}
# Ollama's test drops one trailing space from these templates' output before comparing.
TRAILING_SPACE = {"chatqa.gotmpl", "llama2-chat.gotmpl", "mistral-instruct.gotmpl", "openchat.gotmpl",
                  "vicuna.gotmpl"}


def render(source: str, **values: object) -> str:
    """One execution, as Ollama runs templates: Response is always set (parse appends it when unused)."""
    return parse_go_template(source).execute({"Response": "", **values})


# ---- Ollama's built-in templates ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.gotmpl")))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_builtin_templates_render_what_ollama_expects(name: str, conversation: str) -> None:
    template = parse_go_template((TEMPLATES / name).read_text())
    got = template.render(CONVERSATIONS[conversation])
    if name in TRAILING_SPACE and got.endswith(" "):
        got = got[:-1]
    assert got == (TEMPLATES / "testdata" / name / conversation).read_text()


def test_all_twenty_builtin_templates_and_their_outputs_are_present() -> None:
    names = {p.stem for p in TEMPLATES.glob("*.gotmpl")}
    assert len(names) == 20 and {"llama3-instruct", "chatml", "mistral-instruct", "zephyr", "gemma-instruct"} <= names
    assert {p.name for p in (TEMPLATES / "testdata").iterdir()} == {n + ".gotmpl" for n in names}


def test_builtin_params_are_the_stop_lists() -> None:
    assert json.loads((TEMPLATES / "chatml.json").read_text()) == {"stop": ["<|im_start|>", "<|im_end|>"]}


# ---- TestExecuteWithMessages: legacy templates and message templates give the same prompt ---------

MISTRAL_NO_RESPONSE = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] "
MISTRAL_RESPONSE = "[INST] {{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}[/INST] {{ .Response }}"
MISTRAL_MESSAGES = ('[INST] {{ if .System }}{{ .System }}\n\n{{ end }}\n{{- range .Messages }}\n'
                    '{{- if eq .Role "user" }}{{ .Content }}[/INST] {{ else if eq .Role "assistant" }}'
                    '{{ .Content }}[INST] {{ end }}\n{{- end }}')
CHAT = [{"role": "user", "content": "Hello friend!"}, {"role": "assistant", "content": "Hello human!"},
        {"role": "user", "content": "What is your name?"}]
SYSTEM = [{"role": "system", "content": "You are a helpful assistant!"}]


@pytest.mark.parametrize("source", [MISTRAL_NO_RESPONSE, MISTRAL_RESPONSE, MISTRAL_MESSAGES])
def test_mistral(source: str) -> None:
    assert parse_go_template(source).render(CHAT) == \
        "[INST] Hello friend![/INST] Hello human![INST] What is your name?[/INST] "


@pytest.mark.parametrize("source", [MISTRAL_NO_RESPONSE, MISTRAL_RESPONSE, MISTRAL_MESSAGES])
def test_mistral_system(source: str) -> None:
    assert parse_go_template(source).render(SYSTEM + CHAT) == \
        "[INST] You are a helpful assistant!\n\nHello friend![/INST] Hello human![INST] What is your name?[/INST] "


@pytest.mark.parametrize("source", [
    "[INST] {{ .Prompt }}[/INST] ",
    "[INST] {{ .Prompt }}[/INST] {{ .Response }}",
    '\n{{- range $i, $m := .Messages }}\n{{- if eq .Role "user" }}[INST] {{ .Content }}[/INST] '
    '{{ else if eq .Role "assistant" }}{{ .Content }}{{ end }}\n{{- end }}',
])
def test_mistral_assistant_prefill(source: str) -> None:
    messages = CHAT + [{"role": "assistant", "content": "My name is Ollama and I"}]
    assert parse_go_template(source).render(messages) == \
        "[INST] Hello friend![/INST] Hello human![INST] What is your name?[/INST] My name is Ollama and I"


@pytest.mark.parametrize("source", [
    "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n"
    "{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}<|im_end|>\n",
    "\n{{- range $index, $_ := .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n",
])
def test_chatml(source: str) -> None:
    assert parse_go_template(source).render(SYSTEM + CHAT) == (
        "<|im_start|>system\nYou are a helpful assistant!<|im_end|>\n<|im_start|>user\nHello friend!<|im_end|>\n"
        "<|im_start|>assistant\nHello human!<|im_end|>\n<|im_start|>user\nWhat is your name?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_suffix_runs_with_prompt_and_suffix_only() -> None:
    t = parse_go_template("{{- if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>\n{{- else }}{{ .Prompt }}\n"
                          "{{- end }}")
    assert t.render([{"role": "user", "content": "hello"}]) == "hello"
    assert t.render(prompt="def add(", suffix="return x") == "<PRE> def add( <SUF>return x <MID>"


def test_response_is_appended_when_the_template_uses_neither_messages_nor_response() -> None:
    assert parse_go_template("{{ .Prompt }}").render([{"role": "user", "content": "a"},
                                                     {"role": "assistant", "content": "b"},
                                                     {"role": "user", "content": "c"}]) == "abc"


# ---- TestParse / TestParseError ------------------------------------------------------------------


@pytest.mark.parametrize(("source", "names"), [
    ("{{ .Prompt }}", ["prompt", "response"]),
    ("{{ .System }} {{ .Prompt }}", ["prompt", "response", "system"]),
    ("{{ .System }} {{ .Prompt }} {{ .Response }}", ["prompt", "response", "system"]),
    ("{{ with .Tools }}{{ . }}{{ end }} {{ .System }} {{ .Prompt }}", ["prompt", "response", "system", "tools"]),
    ("{{ range .Messages }}{{ .Role }} {{ .Content }}{{ end }}", ["content", "messages", "role"]),
    ('{{ range .Messages }}{{ if eq .Role "tool" }}Tool Result: {{ .ToolName }} {{ .Content }}{{ end }}{{ end }}',
     ["content", "messages", "role", "toolname"]),
    ('{{- range .Messages }}\n{{- if eq .Role "system" }}SYSTEM:\n{{- else if eq .Role "user" }}USER:\n'
     '{{- else if eq .Role "assistant" }}ASSISTANT:\n{{- else if eq .Role "tool" }}TOOL:\n{{- end }} {{ .Content }}\n'
     "{{- end }}", ["content", "messages", "role"]),
    ("{{- if .Messages }}\n{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
     "<|im_start|>assistant\n{{ else -}}\n{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
     "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ .Response }}"
     "<|im_end|>\n{{- end -}}", ["content", "messages", "prompt", "response", "role", "system"]),
])
def test_vars(source: str, names: list[str]) -> None:
    assert parse_go_template(source).vars() == names


@pytest.mark.parametrize(("source", "message"), [
    ("{{ .Prompt ", "unclosed action"),
    ('{{define "x"}}{{template "x"}}{{end}}{{template "x"}}', "undefined template specified"),
    ("{{ if .A }}x", "missing {{end}}"),
    ("{{ end }}", "unexpected {{end}}"),
    ("{{ $x }}", "undefined variable"),
    ("{{ break }}", "outside {{range}}"),
    ("{{ .A | }}", "missing value"),
])
def test_parse_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError, match="(?i)" + message.replace("{", r"\{").replace("}", r"\}")):
        parse_go_template(source)


# ---- TestCollate ---------------------------------------------------------------------------------


def test_collate_merges_same_role_runs_but_not_tool_messages() -> None:
    system, merged = collate([{"role": "system", "content": "You are helpful"}, {"role": "user", "content": "Hello"},
                              {"role": "user", "content": "How are you?"},
                              {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
                              {"role": "tool", "content": "72F", "tool_name": "get_temperature"}])
    assert system == "You are helpful"
    assert [(m["role"], m["content"], m.get("tool_name")) for m in merged] == [
        ("system", "You are helpful", None), ("user", "Hello\n\nHow are you?", None),
        ("tool", "sunny", "get_weather"), ("tool", "72F", "get_temperature")]


def test_system_messages_are_joined_for_dot_system() -> None:
    t = parse_go_template("{{ .System }}|{{ range .Messages }}{{ .Role }};{{ end }}")
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "u"}, {"role": "system", "content": "b"}]
    assert t.render(msgs) == "a\n\nb|system;user;system;"


# ---- tools: arguments and properties print as JSON and range in key order -----------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
CALL = {"role": "assistant", "tool_calls": [{"function": {"name": "get_weather",
                                                          "arguments": {"unit": "celsius", "location": "Tokyo"}}}]}


def test_tool_call_arguments_print_as_json() -> None:
    t = parse_go_template("{{- range .Messages }}{{- range .ToolCalls }}{{ .Function.Arguments }}{{- end }}{{- end }}")
    assert t.render([CALL]) == '{"location":"Tokyo","unit":"celsius"}'


def test_tool_call_arguments_range_in_key_order() -> None:
    t = parse_go_template("{{- range .Messages }}{{- range .ToolCalls }}{{- range $k, $v := .Function.Arguments }}"
                          "{{ $k }}={{ $v }};{{- end }}{{- end }}{{- end }}")
    assert t.render([CALL]) == "location=Tokyo;unit=celsius;"


def test_tool_properties_print_as_json_and_range() -> None:
    t = parse_go_template("{{- range .Messages }}{{- end }}{{- range .Tools }}{{ .Function.Parameters.Properties }}"
                          "|{{- range $name, $prop := .Function.Parameters.Properties }}{{ $name }}:{{ $prop.Type }};"
                          "{{- end }}{{- end }}")
    props, ranged = t.render([{"role": "user", "content": "test"}], tools=[WEATHER_TOOL]).split("|")
    assert json.loads(props) == {"location": {"type": "string", "description": "City name"},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}
    assert ranged == "location:string;unit:string;"


def test_tools_print_as_json_in_ollama_field_order() -> None:
    t = parse_go_template("{{ range .Messages }}{{ end }}{{ .Tools }}")
    assert t.render([], tools=[WEATHER_TOOL]) == (
        '[{"type":"function","function":{"name":"get_weather","description":"Get weather","parameters":'
        '{"type":"object","required":["location"],"properties":{"location":{"type":"string","description":'
        '"City name"},"unit":{"type":"string","enum":["celsius","fahrenheit"]}}}}}]')


def test_command_r_renders_tools_and_tool_results() -> None:
    t = parse_go_template((TEMPLATES / "command-r.gotmpl").read_text())
    assert "tools" in t.vars()
    out = t.render([{"role": "user", "content": "Weather in Tokyo?"}, CALL,
                    {"role": "tool", "content": "sunny", "tool_name": "get_weather"}], tools=[WEATHER_TOOL])
    assert "def get_weather(location: string, unit: string, ) -> List[Dict]:" in out
    assert "        location (string): City name" in out
    assert '"tool_name": "get_weather",\n        "parameters": {"location":"Tokyo","unit":"celsius"}' in out
    assert out.endswith("<results>\nconsole_output: sunny\n</results><|END_OF_TURN_TOKEN|><|END_OF_TURN_TOKEN|>"
                        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>\n")  # the file's final newline


def test_llama3_style_json_function() -> None:
    t = parse_go_template('{{ range .Messages }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", '
                          '"parameters": {{ json .Function.Arguments }}}{{ end }}{{ end }}')
    assert json.loads(t.render([CALL])) == {"name": "get_weather",
                                            "parameters": {"location": "Tokyo", "unit": "celsius"}}


def test_date_functions() -> None:
    t = parse_go_template("{{- range .Messages }}{{ .Content }}{{ end }} Today is {{ currentDate }}, "
                          "yesterday {{ yesterdayDate }}")
    today = datetime.date.today()
    assert t.render([{"role": "user", "content": "Hello"}]) == \
        f"Hello Today is {today.isoformat()}, yesterday {(today - datetime.timedelta(days=1)).isoformat()}"


# ---- Go text/template semantics ------------------------------------------------------------------


@pytest.mark.parametrize(("source", "values", "expected"), [
    ("a  {{- .X -}}  b", {"X": 1}, "a1b"),
    ("a {{- /* comment */ -}} b", {}, "ab"),
    ("a{{/* comment */}}b", {}, "ab"),
    ("{{ .X }}", {}, "<no value>"),  # missingkey=zero on a map of interfaces prints Go's <no value>
    ("{{ if .X }}yes{{ else }}no{{ end }}", {"X": ""}, "no"),
    ("{{ if .X }}yes{{ else }}no{{ end }}", {"X": []}, "no"),
    ("{{ if .X }}yes{{ else }}no{{ end }}", {"X": 0}, "no"),
    ("{{ if .X }}yes{{ else if .Y }}y{{ else }}no{{ end }}", {"Y": 1}, "y"),
    ("{{ with .X }}{{ . }}{{ else }}none{{ end }}", {"X": "v"}, "v"),
    ("{{ with .X }}{{ . }}{{ else }}none{{ end }}", {}, "none"),
    ("{{ with .X }}{{ . }}{{ else with .Y }}y={{ . }}{{ end }}", {"Y": 2}, "y=2"),
    ("{{ range .L }}{{ . }},{{ else }}empty{{ end }}", {"L": []}, "empty"),
    ("{{ range $i, $e := .L }}{{ $i }}:{{ $e }} {{ end }}", {"L": ["a", "b"]}, "0:a 1:b "),
    ("{{ range $e := .L }}{{ $e }}{{ end }}", {"L": ["a", "b"]}, "ab"),
    ("{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}",
     {"L": [1, 2, 3, 4, 5]}, "13"),
    ("{{ range $k, $v := .M }}{{ $k }}={{ $v }} {{ end }}", {"M": {"b": 2, "a": 1}}, "a=1 b=2 "),
    ("{{ $x := 1 }}{{ range .L }}{{ $x = . }}{{ end }}{{ $x }}", {"L": [5, 6]}, "6"),
    ("{{ range .L }}{{ $.Name }}{{ end }}", {"L": [1, 2], "Name": "n"}, "nn"),
    ('{{ eq .R "a" "b" }} {{ ne .R "a" }}', {"R": "b"}, "true true"),
    ("{{ and 1 0 }} {{ or 0 \"\" 3 }} {{ not 0 }}", {}, "0 3 true"),
    ("{{ and .X .X.Missing }}", {"X": None}, "<no value>"),  # and stops at the first false value
    ("{{ len .L }} {{ len .S }}", {"L": [1, 2, 3], "S": "héllo"}, "3 6"),  # len of a string counts bytes
    ("{{ index .L 1 }} {{ index .M \"k\" }}", {"L": ["a", "b"], "M": {"k": "v"}}, "b v"),
    ("{{ slice .L 1 }} {{ slice .L 0 1 }} {{ slice .S 1 3 }}", {"L": [1, 2, 3], "S": "abcd"}, "[2 3] [1] bc"),
    ("{{ lt 1 2 }} {{ le 2 2 }} {{ gt 1 2 }} {{ ge 3 2 }}", {}, "true true false true"),
    ('{{ .S | printf "%s!" }} {{ print 1 2 }} {{ print "a" "b" }}', {"S": "x"}, "x! 1 2 ab"),
    ("{{ (index .L 0).Name }}", {"L": [{"Name": "first"}]}, "first"),
    ("{{ 1.5 }} {{ 42.0 }} {{ true }} {{ 0x10 }} {{ `raw` }} {{ \"a\\tb\" }}", {}, "1.5 42 true 16 raw a\tb"),
    ('{{ json .M }}', {"M": {"b": "<tag>", "a": 1.0}}, '{"a":1,"b":"\\u003ctag\\u003e"}'),
    ("{{ .M }}", {"M": {"b": 1, "a": [1, 2]}}, "map[a:[1 2] b:1]"),
])
def test_go_semantics(source: str, values: dict, expected: str) -> None:
    assert render(source, **values) == expected


@pytest.mark.parametrize(("source", "values", "message"), [
    ("{{ range .Messages }}{{ .Nope }}{{ end }}", {"Messages": None}, None),
    ('{{ eq "a" 1 }}', {}, "incompatible types"),
    ("{{ nosuch 1 }}", {}, 'function "nosuch" not defined'),
    ("{{ index .L 5 }}", {"L": [1]}, "out of range"),
    ("{{ .X.Y }}", {}, "nil pointer"),
    ("{{ .S 1 }}", {"S": "x"}, "non-function"),
])
def test_go_execution_errors(source: str, values: dict, message: str | None) -> None:
    if message is None:  # a range over nil runs nothing: no error
        assert render(source, **values) == ""
        return
    with pytest.raises(TemplateError, match=message):
        render(source, **values)


def test_message_fields_are_a_struct_an_unknown_field_is_an_error() -> None:
    t = parse_go_template("{{ range .Messages }}{{ .Nope }}{{ end }}")
    with pytest.raises(TemplateError, match="can't evaluate field Nope"):
        t.render([{"role": "user", "content": "x"}])


def test_parse_returns_go_template() -> None:
    t = GoTemplate.parse("{{ .Prompt }}")
    assert t.source == "{{ .Prompt }}" and "response" in t.vars()


# ---- Go JSON bytes ----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ({"b": 1, "a": [True, None]}, '{"a":[true,null],"b":1}'),
    (GoStruct(z=1, a=2), '{"z":1,"a":2}'),
    ("<a&b>\u2028\n\x01é", '"\\u003ca\\u0026b\\u003e\\u2028\\n\\u0001é"'),
    (42.0, "42"), (0.9, "0.9"), (1e21, "1e+21"), (1e-7, "1e-7"), (123456789.0, "123456789"),
    (Float32(0.1), "0.1"), (Float32(0.123456789), "0.12345679"), (-0.0, "-0"),
])
def test_go_json(value: object, expected: str) -> None:
    assert go_json(value) == expected


# ---- the GGUF's Jinja chat template, rendered as transformers renders it -----------------------


def test_jinja_environment_is_hugging_face_s() -> None:
    source = ("{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]"
              "{% generation %}G{% endgeneration %}\n"
              "  {% endif %}\n{% if loop.index == 1 %}{% break %}{% endif %}\n{% endfor %}"
              "{{ tools | tojson }}|{{ {'b': '<x>', 'a': 1} | tojson }}")
    out = ChatTemplate(source).render([{"role": "user", "content": "hi"}, {"role": "user", "content": "never"}],
                                      tools=[{"type": "function", "function": {"name": "f"}}])
    # trim_blocks + lstrip_blocks; loop controls; generation block; tojson keeps key order, no HTML escaping
    assert out == '[hi]G[{"type": "function", "function": {"name": "f"}}]|{"b": "<x>", "a": 1}'


def test_jinja_raise_exception_and_strftime_now() -> None:
    t = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must alternate') }}"
                     "{% endif %}{{ strftime_now('%Y') }}")
    assert t.render([{"role": "user", "content": "x"}]) == str(datetime.date.today().year)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        t.render([{"role": "assistant", "content": "x"}])


def test_jinja_sandbox_refuses_to_mutate_inputs_and_reach_python() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}").render([])
    assert issubclass(ChatTemplateError, ValueError) and not issubclass(ChatTemplateError, jinja2.TemplateError)


def test_jinja_tool_calls_and_tool_results_in_openai_shape() -> None:
    t = ChatTemplate("{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}"
                     "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{{ m.get('name', '') }}"
                     "{{ m.content }};{% endfor %}")
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": {"x": 1}}}]}, {"role": "tool", "content": "42", "tool_name": "f"}]
    assert t.render(messages) == 'assistant:f{"x": 1};tool:f42;'


def test_jinja_variables_bos_eos_generation_prompt_and_thinking() -> None:
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}"
                     "{{ eos_token }}{{ enable_thinking }}", bos_token="<s>", eos_token="</s>")
    assert t.render([{"role": "user", "content": "x"}], think=False) == "<s>x></s>False"
    assert t.render([{"role": "user", "content": "x"}], add_generation_prompt=False, enable_thinking=1) == "<s>x</s>1"


def test_no_double_bos() -> None:
    t = ChatTemplate("{{ bos_token }}[INST] {{ messages[0].content }}", bos_token="<s>", add_bos=True)
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[INST] hi"
    assert t.prompt([{"role": "user", "content": "hi"}]) == "[INST] hi"
    assert strip_bos("<s>x", "<s>", tokenizer_adds_bos=False) == "<s>x"
    assert strip_bos("x<s>", "<s>", tokenizer_adds_bos=True) == "x<s>"
    assert strip_bos("<s>x", "", tokenizer_adds_bos=True) == "<s>x"


def test_template_capabilities() -> None:
    assert template_capabilities("{% if tools %}{% endif %}<think></think>") == ["tools", "thinking"]
    assert template_capabilities("{{ messages }}") == []


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_path: Path) -> dict:
    from ollama_engine.fs import GGUFFile

    return GGUFFile.open(smollm2_path).metadata


def test_smollm2_chat_template(smollm2_metadata: dict) -> None:
    t = ChatTemplate.from_metadata(smollm2_metadata)
    assert t is not None and t.bos_token == "<|im_start|>" and t.eos_token == "<|im_end|>" and t.add_bos is False
    assert t.prompt([{"role": "user", "content": "What is 2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert t.prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_prompt_equals_transformers_rendering_with_jinja_directly(smollm2_metadata: dict) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source = smollm2_metadata["tokenizer.chat_template"]
    messages = [{"role": "user", "content": "Tell me a joke about <tags> & \"quotes\""}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    assert ChatTemplate.from_metadata(smollm2_metadata).render(messages) == \
        plain.render(messages=messages, add_generation_prompt=True, bos_token="<|im_start|>")


def test_smollm2_stops_at_every_end_of_generation_token(smollm2_metadata: dict) -> None:
    vocab = Vocabulary(smollm2_metadata)
    eog = end_of_generation(vocab)
    assert eog[2] == "<|im_end|>" and eog[0] == "<|endoftext|>"
    assert stop_words(vocab, {"stop": ["<|im_start|>"]})[:3] == ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]


def test_missing_chat_template_gives_none() -> None:
    assert ChatTemplate.from_metadata({"tokenizer.ggml.tokens": ["a"]}) is None
    t = ChatTemplate.from_metadata({"tokenizer.chat_template": "x", "tokenizer.ggml.model": "llama",
                                    "tokenizer.ggml.tokens": ["<unk>", "<s>"], "tokenizer.ggml.bos_token_id": 1})
    assert t is not None and t.bos_token == "<s>" and t.add_bos  # SentencePiece adds BOS unless the GGUF says not


# ---- stops ---------------------------------------------------------------------------------------


def small_vocab(tokens: list[str], **ids: int) -> Vocabulary:
    metadata: dict = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    metadata.update({f"tokenizer.ggml.{k}_token_id": v for k, v in ids.items()})
    return Vocabulary(metadata)


def test_eos_eot_and_eom_all_stop() -> None:
    vocab = small_vocab(["a", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "b"], bos=1, eos=2)
    assert end_of_generation(vocab) == {2: "<|end_of_text|>", 3: "<|eot_id|>", 4: "<|eom_id|>"}
    assert stop_words(vocab) == ["<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]
    # the request's stop list replaces the Modelfile's as a whole; the vocabulary's stops always apply
    assert stop_words(vocab, {"stop": ["x"]}, ["y", "<|eot_id|>"]) == ["y", "<|eot_id|>", "<|end_of_text|>",
                                                                       "<|eom_id|>"]


def test_explicit_eot_id_is_a_stop() -> None:
    vocab = small_vocab(["a", "</s>", "<end>", "c"], eos=1, eot=2)
    assert set(end_of_generation(vocab)) == {1, 2}


# ---- tool calls ----------------------------------------------------------------------------------

ARGS = {"location": "Paris", "unit": "celsius"}


def calls(*pairs: tuple[str, dict]) -> list[dict]:
    return [{"function": {"index": i, "name": n, "arguments": a}} for i, (n, a) in enumerate(pairs)]


@pytest.mark.parametrize(("text", "content", "expected"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", calls(("get_weather", ARGS))),
    ('Let me check.<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": 1}}</tool_call>', "Let me check.", calls(("a", {}), ("b", {"x": 1}))),
    ('<tool_call>{"name": "a", "arguments": {"k": "v"}}', "", calls(("a", {"k": "v"}))),  # unclosed at the end
    ('[TOOL_CALLS] [{"name": "a", "arguments": {"k": 1}}, {"name": "b", "arguments": {}}]', "",
     calls(("a", {"k": 1}), ("b", {}))),
    ('<|python_tag|>{"name": "a", "parameters": {"q": "x"}}', "", calls(("a", {"q": "x"}))),
    ('{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}', "",
     calls(("get_weather", ARGS))),
    ('  [{"name": "a", "arguments": "{\\"k\\": 2}"}]  ', "", calls(("a", {"k": 2}))),  # arguments as a JSON string
    ('```json\n{"function": {"name": "a", "arguments": {}}}\n```', "", calls(("a", {}))),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),  # JSON that is not a call is content
    ('{"name": "a", "arguments": {}} and more', '{"name": "a", "arguments": {}} and more', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_parse_tool_calls(text: str, content: str, expected: list) -> None:
    assert parse_tool_calls(text) == (content, expected)


def test_tool_calls_only_to_offered_tools() -> None:
    text = '{"name": "get_weather", "arguments": {"location": "Paris"}}'
    assert parse_tool_calls(text, [WEATHER_TOOL])[1] == calls(("get_weather", {"location": "Paris"}))
    assert parse_tool_calls(text, [{"type": "function", "function": {"name": "other"}}]) == (text, [])


def test_tool_call_stream_holds_back_only_the_call() -> None:
    stream = ToolCallStream()
    pieces = ["Sure", ", checking.", "<tool", '_call>{"name": "a", ', '"arguments": {}}</tool_call>']
    shown = "".join(stream.feed(p) for p in pieces)
    assert shown == "Sure, checking."
    assert stream.finish() == ("", calls(("a", {})))

    stream = ToolCallStream()
    assert stream.feed("  ") == "" and stream.feed('{"name": "a",') == "" and stream.feed(' "arguments": {}}') == ""
    assert stream.finish() == ("", calls(("a", {})))

    stream = ToolCallStream()
    assert stream.feed("Hello <") == "Hello " and stream.feed("b>") == "<b>" and stream.finish() == ("", [])
