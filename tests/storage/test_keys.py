"""Storage key formatting: one tag per key, safe charset, exact round trip."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiocache_kv.errors import InvalidInputError, StorageKeyError
from aiocache_kv.storage.keys import (
    MAX_COMPONENT_LEN,
    MAX_KEY_LEN,
    MAX_TAG_LEN,
    ParsedKey,
    check_keys,
    parse_storage_key,
    storage_key,
)

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


def test_format_is_tag_hash_component() -> None:
    assert storage_key("llama-3-8b", 0xAB) == "llama-3-8b/00000000000000ab/kv"
    assert storage_key("m", 0xAB, "swa") == "m/00000000000000ab/swa"
    assert storage_key("m", (1 << 64) - 1) == "m/ffffffffffffffff/kv"
    assert storage_key("m", 1 << 64) == "m/10000000000000000/kv"


@given(tag=names, component=names, page_hash=st.integers(0, (1 << 256) - 1))
def test_parse_round_trips(tag: str, component: str, page_hash: int) -> None:
    key = storage_key(tag, page_hash, component)
    assert parse_storage_key(key) == ParsedKey(tag, page_hash, component)
    assert key.count("/") == 2  # the tag is applied exactly once


@pytest.mark.parametrize(
    "tag",
    ["", "a/b", "../x", ".hidden", "-x", "tag with space", "é", "a\x00b", "x" * (MAX_TAG_LEN + 1)],
)
def test_bad_tags_are_rejected(tag: str) -> None:
    with pytest.raises(StorageKeyError):
        storage_key(tag, 1)


@pytest.mark.parametrize("component", ["", "kv/x", "x" * (MAX_COMPONENT_LEN + 1), "k v"])
def test_bad_components_are_rejected(component: str) -> None:
    with pytest.raises(StorageKeyError):
        storage_key("tag", 1, component)


@pytest.mark.parametrize("page_hash", [-1, 1 << 256, True, 1.0, "ab", None])
def test_bad_hashes_are_rejected(page_hash: object) -> None:
    with pytest.raises(StorageKeyError):
        storage_key("tag", page_hash)  # type: ignore[arg-type]


def test_storage_key_error_is_an_input_error() -> None:
    with pytest.raises(InvalidInputError):
        storage_key("", 1)


@pytest.mark.parametrize(
    "key",
    [
        "tagA/tagA/00000000000000ab/kv",  # tagged twice
        "00000000000000ab/kv",  # untagged
        "tag/ab/kv",  # short hash
        "tag/00000000000000AB/kv",  # upper-case hex is not what storage_key makes
        "tag/000000000000000001/kv",  # non-canonical leading zeros
        "tag/00000000000000ab/",
        "",
    ],
)
def test_parse_rejects_malformed_keys(key: str) -> None:
    with pytest.raises(StorageKeyError):
        parse_storage_key(key)


def test_check_keys() -> None:
    check_keys(["a", "../../etc/passwd", "a\x00b", "x" * MAX_KEY_LEN])
    for bad in ["", "x" * (MAX_KEY_LEN + 1), "é" * (MAX_KEY_LEN // 2 + 1), 3, b"bytes"]:
        with pytest.raises(StorageKeyError):
            check_keys([bad])  # type: ignore[list-item]
