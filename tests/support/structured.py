"""The stack of the structured-output tests (test_structured_output, test_tools, test_request_parameters),
whose modules import its fixtures: the demo target ending a turn on the tokenizer's EOS, as a real
checkpoint does (the grammar allows it once the value is whole), a draft that follows the grammar too, and
a JSON-schema check for what comes back."""

import pytest

from tests.support.models import demo_target
from tests.support.services import speculative_gateway


@pytest.fixture(scope="module")
def target(tokenizer):
    return demo_target(tokenizer, tokenizer_eos=True)


@pytest.fixture(scope="module")
def stack(target, tokenizer):
    with speculative_gateway(target, tokenizer, draft_tokenizer=tokenizer) as gw:
        yield gw


@pytest.fixture
def client(stack):
    return stack.openai()


def conforms(value, schema) -> bool:
    """A small JSON-schema check covering the keywords these tests use."""
    if "anyOf" in schema:
        return any(conforms(value, s) for s in schema["anyOf"])
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", ()))
            and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
            and all(conforms(value[k], s) for k, s in props.items() if k in value)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", 1 << 30)
            and all(conforms(v, schema["items"]) for v in value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", -(1 << 60)) <= value <= schema.get("maximum", 1 << 60)
        )
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    raise AssertionError(f"the test's checker lacks {schema}")
