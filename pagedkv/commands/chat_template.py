"""`--chat-template` (serve, generate): a file's path or the Jinja template itself, as vLLM's.

`load_chat_template(value)` reads a file when `value` names one; otherwise `value` is the
template when it looks like one (holds `{`, `}` or a newline); anything else is a path that
does not exist (a ValueError naming it, as vLLM's "appears path-like, but doesn't exist").
The template's syntax is checked here, before the model loads.
"""

from __future__ import annotations

from pathlib import Path

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The chat template `value` names (see the module docstring). Raises ValueError naming
    `value` when it is neither a readable file nor a template, or when the template does not
    parse."""
    path = Path(value)
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r}: cannot read it: {exc}") from None
    elif any(char in value for char in _JINJA_CHARS):
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} looks like a path, but no such file "
                         "exists (give a template file or the Jinja template itself)")
    check_syntax(template, value)
    return template


def check_syntax(template: str, source: str) -> None:
    """ValueError naming `source` when `template` is not valid Jinja."""
    from jinja2 import Environment, TemplateSyntaxError

    try:
        Environment().parse(template)
    except TemplateSyntaxError as exc:
        where = "" if exc.lineno is None else f" (line {exc.lineno})"
        raise ValueError(f"--chat-template {_short(source)}: not a valid Jinja "
                         f"template{where}: {exc.message}") from None


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
