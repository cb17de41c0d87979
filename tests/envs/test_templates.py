"""Prompt templates from kwargs: plain fields the env fills, each once, bounded in length."""

import pytest

from areal_agents.envs.templates import MAX_TEMPLATE_CHARS, check_template


def check(template):
    return check_template(template, "prompt_template", fields=("prompt", "question"), required=("prompt",))


def test_plain_templates_pass_and_literal_braces_are_text():
    for template in ("{prompt}", "Q: {question}\n{prompt}\\boxed{{}}", "{prompt:}"):
        assert check(template) == template


@pytest.mark.parametrize(
    "template, fault",
    [
        ("{prompt:>300000000}", "format spec"),
        ("{prompt:{question}}", "format spec"),
        ("{prompt!r}", "conversion"),
        ("{prompt.__class__.__init__}", "not a field"),
        ("{prompt[0]}", "not a field"),
        ("{0}{prompt}", "not a field"),
        ("{}{prompt}", "not a field"),
        ("{answer}{prompt}", "not a field"),
        ("{prompt}{prompt}", "more than once"),
        ("no field", "expects a {prompt} placeholder"),
        ("{prompt", "not a valid template"),
        ("x" * MAX_TEMPLATE_CHARS + "{prompt}", "at most"),
        (["{prompt}"], "expects a string"),
    ],
)
def test_templates_that_could_grow_or_reach_into_an_observation_are_refused(template, fault):
    with pytest.raises(ValueError, match=r"prompt_template: .*" + fault.replace("{", r"\{").replace("}", r"\}")):
        check(template)
