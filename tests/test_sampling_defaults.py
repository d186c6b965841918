"""Default sampling settings from generation_config.json and the command line, and how a
request's omitted fields take them."""

from __future__ import annotations

import json

import pytest

from frontend_proc.errors import APIError
from frontend_proc.sampling_defaults import (
    SamplingDefaults,
    parse_override,
    resolve_sampling_defaults,
)
from frontend_proc.schemas import parse_chat_request, parse_completion_request
from pegainfer.cli import build_parser, config_from_args

MODEL = "m"
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def write_config(folder, values: dict) -> str:
    (folder / "generation_config.json").write_text(json.dumps(values))
    return str(folder)


def test_the_models_own_settings_become_the_defaults(tmp_path):
    model = write_config(tmp_path, QWEN3_GENERATION_CONFIG)
    defaults, notes = resolve_sampling_defaults("auto", model, {})
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert len(notes) == 1 and "temperature=0.6" in notes[0] and "generation_config" in notes[0]


def test_none_keeps_the_neutral_defaults_and_a_folder_without_the_file_is_neutral(tmp_path):
    model = write_config(tmp_path, QWEN3_GENERATION_CONFIG)
    assert resolve_sampling_defaults("none", model, {}) == ({}, [])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve_sampling_defaults("auto", str(empty), {}) == ({}, [])


def test_greedy_only_configs_change_nothing(tmp_path):
    model = write_config(tmp_path, {"do_sample": False, "eos_token_id": 2, "top_k": 0})
    assert resolve_sampling_defaults("auto", model, {}) == ({}, [])


def test_another_folder_or_file_can_be_named(tmp_path):
    model = tmp_path / "model"
    other = tmp_path / "other"
    model.mkdir()
    other.mkdir()
    write_config(model, QWEN3_GENERATION_CONFIG)
    write_config(other, {"temperature": 0.3, "min_p": 0.05, "repetition_penalty": 1.05})
    expected = {"temperature": 0.3, "min_p": 0.05, "repetition_penalty": 1.05}
    assert resolve_sampling_defaults(str(other), str(model), {})[0] == expected
    file = str(other / "generation_config.json")
    assert resolve_sampling_defaults(file, str(model), {})[0] == expected
    with pytest.raises(ValueError, match="no generation_config.json"):
        resolve_sampling_defaults(str(tmp_path / "missing"), str(model), {})


def test_settings_a_request_could_not_carry_are_ignored_with_a_note(tmp_path):
    values = {"temperature": 5.0, "top_p": 0.9, "top_k": "many", "repetition_penalty": 0}
    model = write_config(tmp_path, values)
    defaults, notes = resolve_sampling_defaults("auto", model, {})
    assert defaults == {"top_p": 0.9}
    refused = [note for note in notes if "ignored" in note]
    assert len(refused) == 3
    assert any("'temperature' must be at most 2.0" in note for note in refused)


def test_a_broken_file_stops_the_start(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_sampling_defaults("auto", str(tmp_path), {})
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        resolve_sampling_defaults("auto", str(tmp_path), {})


def test_the_override_wins_over_the_file_even_back_to_neutral(tmp_path):
    model = write_config(tmp_path, QWEN3_GENERATION_CONFIG)
    override = parse_override('{"temperature": 1.0, "min_p": 0.1}')
    defaults, notes = resolve_sampling_defaults("auto", model, override)
    assert defaults == {"top_p": 0.95, "top_k": 20, "min_p": 0.1}
    assert "--override-generation-config" in notes[-1]
    assert resolve_sampling_defaults("none", model, {"top_k": 5})[0] == {"top_k": 5}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{temperature: 1}", "not JSON"),
        ("[0.5]", "JSON object"),
        ('{"temprature": 0.5}', "unknown setting"),
        ('{"temperature": 9}', "at most 2.0"),
        ('{"top_p": 0}', "greater than 0.0"),
        ('{"top_k": 1.5}', "integer"),
    ],
)
def test_a_bad_override_is_refused_at_once(text, message):
    with pytest.raises(ValueError, match=message):
        parse_override(text)
    args = build_parser().parse_args(["--override-generation-config", text])
    with pytest.raises(SystemExit, match=message):
        config_from_args(args)


def test_the_command_line_reaches_the_engine_config():
    args = build_parser().parse_args(
        ["--generation-config", "none", "--override-generation-config", '{"top_k": 0}']
    )
    config = config_from_args(args)
    assert config.generation_config == "none"
    assert config.generation_config_override == {"top_k": -1}
    default = config_from_args(build_parser().parse_args([]))
    assert (default.generation_config, default.generation_config_override) == ("auto", {})


QWEN3_DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.01)


def settings(sampling) -> tuple:
    s = sampling
    return (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty)


def test_omitted_and_null_fields_take_the_defaults():
    completion = parse_completion_request({"prompt": "hi"}, MODEL, QWEN3_DEFAULTS)
    assert settings(completion.sampling) == (0.6, 0.95, 20, 0.01, 1.0)
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": None, "top_k": None}
    chat = parse_chat_request(body, MODEL, QWEN3_DEFAULTS)
    assert settings(chat.sampling) == (0.6, 0.95, 20, 0.01, 1.0)
    neutral = parse_completion_request({"prompt": "hi"}, MODEL)
    assert settings(neutral.sampling) == (1.0, 1.0, -1, 0.0, 1.0)


def test_a_requests_own_fields_win_over_the_defaults():
    body = {
        "prompt": "hi",
        "temperature": 0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.2,
    }
    request = parse_completion_request(body, MODEL, QWEN3_DEFAULTS)
    assert settings(request.sampling) == (0.0, 1.0, -1, 0.0, 1.2)
    bad = {"prompt": "hi", "temperature": 3}
    with pytest.raises(APIError, match="temperature") as refused:
        parse_completion_request(bad, MODEL, QWEN3_DEFAULTS)
    assert refused.value.status == 400 and refused.value.param == "temperature"


def test_max_new_tokens_is_a_ceiling_on_max_tokens(tmp_path):
    from frontend_proc.limits import resolve_max_tokens

    model = write_config(tmp_path, {**QWEN3_GENERATION_CONFIG, "max_new_tokens": 32})
    defaults, notes = resolve_sampling_defaults("auto", model, {})
    assert defaults["max_new_tokens"] == 32 and "max_new_tokens=32" in notes[-1]
    capped = SamplingDefaults.from_dict(defaults)
    chat = {"messages": [{"role": "user", "content": "hi"}]}

    def resolved(body, prompt_len=10, max_model_len=1000, is_chat=True):
        parse = parse_chat_request if is_chat else parse_completion_request
        sampling = parse(body, MODEL, capped).sampling
        return resolve_max_tokens(prompt_len, sampling, max_model_len, is_chat).max_tokens

    assert resolved(chat) == 32  # filling the context, capped
    assert resolved(chat, prompt_len=990) == 10  # the context is the tighter bound
    assert resolved({**chat, "max_tokens": 500}) == 32  # a request's own value, capped
    assert resolved({**chat, "max_completion_tokens": 7}) == 7
    assert resolved({"prompt": "hi"}, is_chat=False) == 16  # the completions default
    # A request that does not fit the window is still refused, as without the cap.
    with pytest.raises(APIError, match="maximum context length"):
        resolved({**chat, "max_tokens": 995})
    with pytest.raises(APIError, match="min_tokens"):
        resolved({**chat, "min_tokens": 40})
    assert resolved(chat, max_model_len=1000) == 32
    assert parse_override('{"max_new_tokens": 8}') == {"max_new_tokens": 8}
    with pytest.raises(ValueError, match="at least 1"):
        parse_override('{"max_new_tokens": 0}')
