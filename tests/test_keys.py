"""Conversation keys: equal prompts share keys, anything that changes the prompt does not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproxy import keys


def chain(
    messages: list[dict[str, Any]], request: dict[str, Any] | None = None, tenant: str | None = None
) -> list[str]:
    ns = keys.namespace("model-a", request or {}, tenant)
    return keys.chain(ns, messages)


SYSTEM = {"role": "system", "content": "You are helpful."}
USER = {"role": "user", "content": "Hello"}
SALT = bytes(range(32))


def test_every_message_boundary_has_a_prefix_key() -> None:
    turn1 = chain([SYSTEM, USER])
    reply = {"role": "assistant", "content": "Hi!"}
    turn2 = chain([SYSTEM, USER, reply, {"role": "user", "content": "More"}])
    assert len(turn2) == 4
    assert turn2[:2] == turn1
    assert keys.extend(turn1[-1], reply) == turn2[2]
    assert all(keys.is_key(k) for k in turn2)


def test_empty_content_forms_are_the_same() -> None:
    forms: list[object] = [None, "", []]
    results = {tuple(chain([{"role": "assistant", "content": f}])) for f in forms}
    assert len(results) == 1


def test_a_trimmed_echo_keys_like_the_reply() -> None:
    """Clients trim replies before echoing them; the key must still find the saved state."""
    generated = chain([{"role": "assistant", "content": "The answer.  \n"}])
    assert generated == chain([{"role": "assistant", "content": "The answer."}])
    assert generated != chain([{"role": "assistant", "content": "The answer!"}])


def test_text_parts_key_like_the_joined_string() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chain([{"role": "user", "content": parts}]) == chain(
        [{"role": "user", "content": "a\nb"}]
    )
    image = [{"type": "image_url", "image_url": {"url": "data:x"}}]
    assert chain([{"role": "user", "content": image}]) != chain([{"role": "user", "content": ""}])


def test_tool_call_arguments_compare_as_json() -> None:
    def call(args: str) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
            ],
        }

    assert chain([call('{"x":1}')]) == chain([call('{"x": 1}')])
    assert chain([call('{"x":1}')]) != chain([call('{"x":2}')])


@pytest.mark.parametrize(
    "change",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"reasoning_effort": "high"},
    ],
)
def test_prompt_shaping_fields_change_the_namespace(change: dict[str, Any]) -> None:
    assert chain([USER], change) != chain([USER])


def test_sampling_fields_do_not_change_keys() -> None:
    assert chain([USER], {"temperature": 0.2, "max_tokens": 5, "stream": True}) == chain([USER])


def test_tenants_and_models_are_separate() -> None:
    assert chain([USER], tenant="a") != chain([USER], tenant="b")
    ns_other = keys.namespace("model-b", {}, None)
    assert keys.chain(ns_other, [USER]) != chain([USER])


def test_one_character_changes_the_key_from_there_on() -> None:
    a = chain([SYSTEM, USER, {"role": "user", "content": "x"}])
    b = chain(
        [{"role": "system", "content": "You are helpful!"}, USER, {"role": "user", "content": "x"}]
    )
    assert not set(a) & set(b)


def test_tenant_comes_from_header_or_bearer() -> None:
    assert keys.tenant_of({}, None, SALT) is None
    a = keys.tenant_of({"Authorization": "Bearer a"}, None, SALT)
    b = keys.tenant_of({"Authorization": "Bearer b"}, None, SALT)
    assert a and b and a != b
    assert keys.tenant_of({"X-Team": "red"}, "X-Team", SALT) != keys.tenant_of(
        {"X-Team": "blue"}, "X-Team", SALT
    )


def test_a_tenants_hash_depends_on_the_installs_salt() -> None:
    """Who knows a client's key cannot tell its tenant's hash without the salt."""
    here = keys.tenant_of({"Authorization": "Bearer k"}, None, SALT)
    there = keys.tenant_of({"Authorization": "Bearer k"}, None, bytes(32))
    assert here and there and here != there


@pytest.mark.parametrize(
    "bad",
    [["not a message"], [{"role": 3, "content": "x"}], [{"role": "user", "content": 5}]],
)
def test_unkeyable_messages_raise(bad: list[Any]) -> None:
    with pytest.raises(keys.UnkeyableRequest):
        chain(bad)


def test_a_large_conversation_keys() -> None:
    big = [{"role": "user" if i % 2 else "assistant", "content": "x" * 2000} for i in range(500)]
    result = chain(big)
    assert len(result) == 500 and len(set(result)) == 500


def test_keys_are_the_ones_every_cache_on_disk_was_filed_under() -> None:
    # A key that changed would orphan every user's saved conversations: these values were
    # computed by the first implementation and must never change.
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"path": "."}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    ]
    ns = keys.namespace("gemma-3-270m", {"tools": [{"type": "function"}]}, "tenantA")
    assert ns == "719e2182a688e78c462240a293762a29"
    assert keys.chain(ns, messages) == [
        "01cdc366bcffc59d9562284d62ad9a27",
        "049f1f7b3d63bbd90bcc0a536ba45a68",
        "be351a8fc6071940c140e203696d1a0f",
        "82ba6491259e7faf23b3a5c4b9682e4e",
    ]
    assert keys.extend(ns, messages[0]) == "01cdc366bcffc59d9562284d62ad9a27"
    assert (
        keys.tenant_of({"Authorization": "Bearer k"}, None, SALT)
        == "1181312739579c080873a7a3548fe4bb"
    )
    assert keys.stem(ns, "system", "You are") == "439ece7cc1abd73312b56b6f4ba902d9"


@given(
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=12),
    st.lists(st.sampled_from(["a", "b", "c"]), max_size=12),
)
def test_shared_chain_is_the_shared_prefix_of_two_conversations(
    first: list[str], second: list[str]
) -> None:
    # Bisection relies on each key hashing the one before it: checked against the plain scan.
    one = chain([{"role": "user", "content": text} for text in first])
    two = chain([{"role": "user", "content": text} for text in second])
    assert keys.shared_chain(one, two) == keys.shared_prefix(one, two)
    assert keys.shared_chain(one, one[: len(one) // 2]) == len(one) // 2
