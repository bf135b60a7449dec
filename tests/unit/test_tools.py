"""Tool calls in Llama 3.1's JSON format without an engine: the shipped chat template renders tools, calls and tool
results as Meta's format has them, vLLM's llama3_json parser (through the adapter) reads canned model output, and
the YAML's tool settings are checked before deploy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.build.engine_checks import ENGINE_CONTEXT
from app.config import ModelConfig
from deployments.engine import tool_parser

TEMPLATE = Path(__file__).resolve().parents[2] / "serve_configs/templates/llama3.1-json-tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a town.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from app.clusters.tiny_model import make_tiny_model

    return AutoTokenizer.from_pretrained(str(make_tiny_model(tmp_path_factory.mktemp("m"))))


def render(tokenizer, messages, tools=None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True
    )


def test_the_template_puts_tools_in_the_first_user_turn(tokenizer):
    text = render(
        tokenizer,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
    )
    system, user = text.split("<|eot_id|>")[:2]
    assert system.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert system.endswith("Be brief.")
    assert user.startswith("<|start_header_id|>user<|end_header_id|>\n\n") and user.endswith("Weather?")
    assert json.loads(user[user.index("{\n") : user.rindex("}") + 1]) == WEATHER  # the tool, as JSON
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    plain = render(tokenizer, [{"role": "user", "content": "Hi"}])
    assert "Environment: ipython" not in plain and "function" not in plain


def test_the_template_renders_a_call_and_its_result(tokenizer):
    text = render(
        tokenizer,
        [
            {"role": "user", "content": "Weather in Zermatt?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Zermatt"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c0", "content": '{"forecast": "snow"}'},
        ],
        tools=[WEATHER],
    )
    assert (
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Zermatt"}}'
        "<|eom_id|>"
    ) in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"forecast": "snow"}<|eot_id|>' in text


@pytest.mark.parametrize(
    "output, calls",
    [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zermatt"}}',
            [("get_weather", {"city": "Zermatt"})],
        ),
        (
            '{"name": "get_weather", "arguments": {"city": "Chamonix"}}; '
            '{"name": "get_route", "parameters": {"peak": "Eiger"}}',
            [("get_weather", {"city": "Chamonix"}), ("get_route", {"peak": "Eiger"})],
        ),
        ("The weather in Zermatt is snowy.", []),
        ('{"city": "Zermatt"}', []),  # JSON that is not a call stays content
    ],
)
def test_the_llama3_json_parser_reads_canned_output(tokenizer, output, calls):
    parser = tool_parser("llama3_json")(tokenizer)
    info = parser.extract_tool_calls(output, request=None)
    assert info.tools_called == bool(calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == calls
    if not calls:
        assert info.content == output


def model(**frontend_kwargs) -> dict:
    return {"name": "m", "source": "/models/m", "accelerator": "cpu", "frontend_kwargs": frontend_kwargs}


def test_tool_settings_are_checked_before_deploy():
    with pytest.raises(
        ValidationError, match="frontend_kwargs.enable_auto_tool_choice needs frontend_kwargs.tool_call_parser"
    ):
        ModelConfig.model_validate(model(enable_auto_tool_choice=True), context=ENGINE_CONTEXT)
    with pytest.raises(
        ValidationError, match=r"frontend_kwargs.tool_call_parser 'llama3-json' is not one of .*llama3_json"
    ):
        ModelConfig.model_validate(
            model(enable_auto_tool_choice=True, tool_call_parser="llama3-json"), context=ENGINE_CONTEXT
        )
    ok = ModelConfig.model_validate(
        model(
            enable_auto_tool_choice=True,
            tool_call_parser="llama3_json",
            chat_template="serve_configs/templates/llama3.1-json-tools.jinja",
        ),
        context=ENGINE_CONTEXT,
    )
    assert ok.frontend_kwargs["tool_call_parser"] == "llama3_json"
    assert ok.frontend_kwargs["chat_template"] == str(TEMPLATE)  # a relative path, found in Summit's directory
    with pytest.raises(ValidationError, match="frontend_kwargs.chat_template 'templates/nonesuch.jinja': no such file"):
        ModelConfig.model_validate(model(chat_template="templates/nonesuch.jinja"), context=ENGINE_CONTEXT)
