"""No secret in a log line (issue 9, item 5): a bearer credential or the value of a
credential-named key is masked in text and JSON lines alike, whether it comes in the
message, a structured field, a metadata tuple or a traceback, while ordinary text (and
names like ``token_sha256``) is left alone."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from squall_server.common.config import LogConfig
from squall_server.common.logs import REDACTED, log_fields, redact, setup_logging

SECRET = "sq-FAKE-7f3a9c1e2b"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_squall_handler", False):
            root.removeHandler(handler)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"authorization=Bearer {SECRET}", f"authorization=Bearer {REDACTED}"),
        (f"(('authorization', 'Bearer {SECRET}'),)", f"(('authorization', '{REDACTED}'),)"),
        (f'{{"token": "{SECRET}"}}', f'{{"token": "{REDACTED}"}}'),
        (f"Authorization: Basic {SECRET}", f"Authorization: {REDACTED}"),
        ("Basic c3E6RkFLRTdmM2E5YzFl", f"Basic {REDACTED}"),
        (f"GET /x?token={SECRET}&y=1", f"GET /x?token={REDACTED}&y=1"),
        (f'password="{SECRET} two" x=1', f'password="{REDACTED}" x=1'),
        (f"api_key={SECRET}", f"api_key={REDACTED}"),
        ("token_sha256=9f86d081884c7d65", "token_sha256=9f86d081884c7d65"),
        ("tokens=5 a token in prose", "tokens=5 a token in prose"),
        ("basic checks passed", "basic checks passed"),
        (
            f"exporting to http://squall:{SECRET}@127.0.0.1:4317",
            f"exporting to http://squall:{REDACTED}@127.0.0.1:4317",
        ),
        (
            f"traces to squall:{SECRET}@127.0.0.1:9, retrying",
            f"traces to squall:{REDACTED}@127.0.0.1:9, retrying",
        ),
        ("peer 127.0.0.1:7101 at 12:00:01", "peer 127.0.0.1:7101 at 12:00:01"),
        ("group n1:c2d8624e3a9848bf [recovery]", "group n1:c2d8624e3a9848bf [recovery]"),
        ("became master epoch=4 lsn=17", "became master epoch=4 lsn=17"),
    ],
)
def test_redact_masks_credentials_and_leaves_the_rest(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_service_log_line_never_carries_a_secret(fmt: str, stream: io.StringIO) -> None:
    setup_logging(LogConfig(format=fmt), "gateway", "g1", stream=stream)
    log = logging.getLogger("squall.test")
    metadata = (("authorization", f"Bearer {SECRET}"), ("x-trace", "abc"))
    log.warning("call from peer with metadata %s", metadata)
    log_fields(log, logging.INFO, "field", authorization=f"Bearer {SECRET}", token=SECRET)
    try:
        raise ValueError(f"bad header authorization: Bearer {SECRET}")
    except ValueError:
        log.exception("handler failed")
    output = stream.getvalue()
    assert SECRET not in output
    assert output.count(REDACTED) >= 4
    assert "x-trace" in output and "handler failed" in output
    if fmt == "json":
        for line in output.splitlines():
            if line.startswith("{"):
                json.loads(line)  # still one valid object per line


_TOKEN = st.text(
    alphabet=st.characters(whitelist_categories=("Lu", "Ll", "Nd"), whitelist_characters="-._~+/="),
    min_size=8,
    max_size=64,
).filter(lambda t: t.lower() not in {"bearer", "basic"})


@given(
    token=_TOKEN,
    key=st.sampled_from(["authorization", "Authorization", "token", "password", "x-api-key"]),
    template=st.sampled_from(
        ["{k}=Bearer {t}", "{k}: {t}", "('{k}', 'Bearer {t}')", '"{k}": "{t}"', "{k}={t} rest"]
    ),
)
def test_any_credential_shape_is_masked(token: str, key: str, template: str) -> None:
    assert token not in redact("before " + template.format(k=key, t=token) + " after")
