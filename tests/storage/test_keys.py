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
    storage_keys,
)

names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


H = bytes(31) + b"\xab"  # a 32-byte page hash
HEX = "0" * 62 + "ab"


def test_format_is_tag_hash_component() -> None:
    """The page hash in full: 64 hex digits (a 64-bit key fell to a birthday search)."""
    assert storage_key("llama-3-8b", H) == f"llama-3-8b/{HEX}/kv"
    assert storage_key("m", H, "swa") == f"m/{HEX}/swa"
    assert storage_key("m", b"\xff" * 32) == "m/" + "f" * 64 + "/kv"
    assert storage_keys("m", [H, bytes(32)], "kv") == [f"m/{HEX}/kv", "m/" + "0" * 64 + "/kv"]


@given(tag=names, component=names, page_hash=st.binary(min_size=32, max_size=32))
def test_parse_round_trips(tag: str, component: str, page_hash: bytes) -> None:
    key = storage_key(tag, page_hash, component)
    assert parse_storage_key(key) == ParsedKey(tag, page_hash, component)
    assert key.count("/") == 2  # the tag is applied exactly once


@pytest.mark.parametrize(
    "tag",
    ["", "a/b", "../x", ".hidden", "-x", "tag with space", "é", "a\x00b", "x" * (MAX_TAG_LEN + 1)],
)
def test_bad_tags_are_rejected(tag: str) -> None:
    with pytest.raises(StorageKeyError):
        storage_key(tag, H)


@pytest.mark.parametrize("component", ["", "kv/x", "x" * (MAX_COMPONENT_LEN + 1), "k v"])
def test_bad_components_are_rejected(component: str) -> None:
    with pytest.raises(StorageKeyError):
        storage_key("tag", H, component)


@pytest.mark.parametrize(
    "page_hash",
    [-1, 0xAB, 1 << 255, True, 1.0, "ab", None, bytes(8), bytes(31), bytes(33), bytearray(32)],
)
def test_bad_hashes_are_rejected(page_hash: object) -> None:
    """Only a full-width hash makes a key: a 64-bit int (the old format) is refused."""
    with pytest.raises(StorageKeyError):
        storage_key("tag", page_hash)  # type: ignore[arg-type]
    with pytest.raises(StorageKeyError):
        storage_keys("tag", [bytes(32), page_hash])  # type: ignore[list-item]


@pytest.mark.parametrize("tag", ["", "a/b", "é", "x" * (MAX_TAG_LEN + 1)])
def test_storage_keys_refuse_a_bad_tag_every_time(tag: str) -> None:
    """The checked (tag, component) pairs are remembered; a pair that failed is not: the
    second call raises again, and a good pair's keys are as :func:`storage_key` makes them."""
    for _ in range(2):
        with pytest.raises(StorageKeyError, match="tag"):
            storage_keys(tag, [H])
        with pytest.raises(StorageKeyError, match="component"):
            storage_keys("tag", [H], tag or "a/b")
    assert storage_keys("tag", [H], "swa") == [storage_key("tag", H, "swa")]


class _Tag(str):
    def __format__(self, spec: str) -> str:
        return "other"


def test_storage_keys_take_any_sequence_and_str_subclasses_as_before() -> None:
    hashes = (H, bytes(32))
    assert storage_keys("m", hashes) == [f"m/{HEX}/kv", "m/" + "0" * 64 + "/kv"]  # type: ignore[arg-type]
    assert storage_keys("m", []) == []
    # a str subclass is checked and formatted as an f-string does, never remembered
    assert storage_keys(_Tag("m"), [H]) == [f"other/{HEX}/kv"]
    with pytest.raises(StorageKeyError, match="must be a str"):
        storage_keys(b"m", [H])  # type: ignore[arg-type]


def test_storage_key_error_is_an_input_error() -> None:
    with pytest.raises(InvalidInputError):
        storage_key("", H)


@pytest.mark.parametrize(
    "key",
    [
        f"tagA/tagA/{HEX}/kv",  # tagged twice
        f"{HEX}/kv",  # untagged
        "tag/ab/kv",  # short hash
        "tag/00000000000000ab/kv",  # a 64-bit hash: the old format
        f"tag/{HEX.upper()}/kv",  # upper-case hex is not what storage_key makes
        f"tag/0{HEX}/kv",  # 65 digits
        f"tag/{HEX}/",
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


def test_check_keys_fast_path_keeps_the_byte_bound() -> None:
    """Short plain ``str`` keys skip the per-key check; at the boundary the UTF-8 length
    still decides (4-byte chars), and anything else gets the full check."""
    four = "\U0001f600"  # 4 bytes of UTF-8
    check_keys(["ok", four * (MAX_KEY_LEN // 4)])  # exactly MAX_KEY_LEN bytes
    for bad in [four * (MAX_KEY_LEN // 4 + 1), "é" * (MAX_KEY_LEN // 2 + 1)]:
        with pytest.raises(StorageKeyError):
            check_keys(["fine", bad])

    class Key(str):
        pass

    check_keys([Key("a subclass")])  # accepted, through the full check
    with pytest.raises(StorageKeyError):
        check_keys(["fine", Key("")])
