"""A vision-language folder's chat template, compiled once per folder as transformers'
``apply_chat_template`` runs it (a sandbox with loop controls and ``raise_exception``), with the
variables it reads: the engine renders with it (``vlm_inputs.VlmFormatter``) and a server checks
a request's template options against the same variables before fetching any image
(``check_chat_prompt``)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError, ModelLoadError
from .vlm_chat import ChatPrompt, check_chat_options


def chat_template(folder: Path) -> str:
    """The folder's chat template: chat_template.jinja, chat_template.json, or
    tokenizer_config.json's ``chat_template``."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file():
            template = json.loads(file.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
    raise ModelLoadError(f"{folder}: no chat template (chat_template.jinja or .json)")


def compiled_chat_template(folder: Path) -> tuple[Any, frozenset[str]]:
    """(the folder's chat template compiled, the variables it reads)."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise
    source = chat_template(folder)
    variables = jinja2.meta.find_undeclared_variables(env.parse(source))
    return env.from_string(source), frozenset(variables - set(env.globals))


def check_chat_prompt(prompt: ChatPrompt, folder: Path) -> None:
    """``check_chat_options`` of ``prompt`` against the variables of ``folder``'s template."""
    check_chat_options(prompt, set(_template_variables(folder)))


@lru_cache(maxsize=16)
def _template_variables(folder: Path) -> frozenset[str]:
    # a served folder's files do not change while it is served: read and parsed once
    return compiled_chat_template(folder)[1]


def _raise(message: str):
    raise InvalidInputError(f"the chat template refused the input: {message}", param="input")
