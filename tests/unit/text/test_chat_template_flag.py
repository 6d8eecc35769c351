"""``--chat-template``: a model's template replaced, or given to a model without one."""

from pathlib import Path

import pytest

from trio_llm.cli.main import build_parser, config_from_args, main
from trio_llm.text.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["serve", *flags]))


def test_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert _config("--chat-template", str(path)).chat_template == TEMPLATE
    assert _config("--chat-template", TEMPLATE).chat_template == TEMPLATE
    assert _config().chat_template is None


def test_a_missing_file_or_bad_jinja_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--chat-template", "/no/such/template.jinja"])
    assert info.value.code == 2
    assert "--chat-template: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--chat-template", "{% for m in messages %}"])
    assert "--chat-template:" in capsys.readouterr().err


def test_the_tokenizer_renders_with_the_given_template(real_model_dir: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    own = Tokenizer.load(real_model_dir)
    given = Tokenizer.load(real_model_dir, TEMPLATE)
    assert given.render_chat(messages) == "[user] hi\n[assistant] "
    assert own.render_chat(messages) != given.render_chat(messages)


def test_request_templates_are_off_unless_trusted() -> None:
    default = _config()
    assert default.trust_request_chat_template is False
    assert default.limits.max_request_chat_template_bytes == 64 * 1024
    assert default.limits.request_chat_template_timeout == 2.0
    trusted = _config(
        "--trust-request-chat-template",
        "--max-request-chat-template-bytes",
        "8KiB",
        "--request-chat-template-timeout",
        "0.5",
    )
    assert trusted.trust_request_chat_template is True
    assert trusted.limits.max_request_chat_template_bytes == 8 * 1024
    assert trusted.limits.request_chat_template_timeout == 0.5
