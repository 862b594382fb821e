"""metaclaw.redact, the one masking rule: secrets known by value, addresses, and the values a
configuration file keeps under a secret's name (as ``metaclaw wire`` shows its diff)."""

from __future__ import annotations

import pytest

from metaclaw.redact import mask, mask_config_line, masked_url, safe_url, url_host


@pytest.mark.parametrize("line, shown", [
    ('+      "apiKey": "sk-live-123",\n', '+      "apiKey": "***",\n'),
    ("-  apiKey: 'sk-live-123', // JSON5\n", "-  apiKey: '***', // JSON5\n"),
    ('   "token" = "a\\"b"\n', '   "token" = "***"\n'),
    ("+openai-api-key: sk-live-123  # aider\n", "+openai-api-key: ***  # aider\n"),
    ('+  "headers": {"Authorization": "Bearer sk-live-123"}\n',
     '+  "headers": {"Authorization": "***"}\n'),
    ("+  X-Upstream: bearer sk-live-123, more\n", "+  X-Upstream: bearer ***, more\n"),
    ("+  - OPENAI_API_BASE=http://127.0.0.1:8080/v1\n", "+  - OPENAI_API_BASE=***\n"),
    ('+      "baseUrl": "http://127.0.0.1:8080/v1",\n', '+      "baseUrl": "http://127.0.0.1:8080/v1",\n'),
    ("+  model: gpt-4o\n", "+  model: gpt-4o\n"),
    # Codex's env_key names the variable that holds the token: the name is shown, not a secret
    ('+env_key = "METACLAW_PROXY_TOKEN"\n', '+env_key = "METACLAW_PROXY_TOKEN"\n'),
    ('+experimental_bearer_token = "t0k"\n', '+experimental_bearer_token = "***"\n'),
    ('  env_key = "sk-proj-123"\n', '  env_key = "***"\n'),  # the key put there by mistake
    ('  "api_key_env": "sk-ant-123",\n', '  "api_key_env": "***",\n'),
    ('  "api_key_env": "OPENAI_API_KEY",\n', '  "api_key_env": "OPENAI_API_KEY",\n'),
])
def test_a_config_line_shows_no_value_kept_under_a_secrets_name(line, shown):
    assert mask_config_line(line) == shown


def test_a_calendar_address_is_shown_by_its_host_alone():
    secret = "https://calendar.google.com/calendar/ical/me%40x.org/private-abc123/basic.ics?x=1"
    assert url_host(secret) == "https://calendar.google.com/..."
    assert url_host("webcal://user:pw@cal.example.org/feed.ics") == "webcal://cal.example.org/..."
    assert url_host("http://cal.example.org") == "http://cal.example.org/..."
    assert url_host("~/calendars/work.ics") == "~/calendars/work.ics"  # a file: nothing secret


def test_known_secrets_and_urls_keep_their_rules():
    assert mask("key sk-live-123 and sk-live-123", ("sk-live-123",)) == "key *** and ***"
    assert safe_url("https://u:p@host/v1?key=k#f") == "https://host/v1"
    assert masked_url("postgresql://me:pw@db/x?password=q&sslmode=require") == \
        "postgresql://me:***@db/x?password=***&sslmode=require"


@pytest.mark.parametrize("text, kept", [
    ("use api key sk-proj-AbC123xyz789SECRETkey000 please", "use api key *** please"),
    ("my password is hunter2, log in", "my password is ***, log in"),
    ("password hunter2", "password ***"), ("my pw: hunter2", "my pw: ***"),
    ("passphrase=correct-horse", "passphrase=***"), ("set token=abc123def", "set token=***"),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic ***"),
    ("the token ghp_abcdefghijklmnopqrstuvwxyz012345", "the token ***"),
    ("postgres://admin:S3cretPass@db.example.com/x", "postgres://admin:***@db.example.com/x"),
    ("email the result to alice.smith@example.com", "email the result to <email>"),
    # ordinary words after a credential's name, commit ids, digests and UUIDs stay
    ("the API key is needed", "the API key is needed"),
    ("Reset the password is not working", "Reset the password is not working"),
    ("revert 3f2a9c1b2c3d4e5f60718293a4b5c6d7e8f90a1b", "revert 3f2a9c1b2c3d4e5f60718293a4b5c6d7e8f90a1b"),
    ("run 123e4567-e89b-12d3-a456-426614174000 again", "run 123e4567-e89b-12d3-a456-426614174000 again"),
    ("rename get_user_by_identifier_and_organisation_name",
     "rename get_user_by_identifier_and_organisation_name"),
    ("fix packages/server/src/routes/api/v1/users2", "fix packages/server/src/routes/api/v1/users2"),
    ("rename refactor-the-login-handler-for-oauth2-flow", "rename refactor-the-login-handler-for-oauth2-flow"),
    ("aws secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws secret ***"),
    ("https://user:p@ss@host/path", "https://user:***@host/path"),
])
def test_an_ask_keeps_its_words_and_loses_its_credentials(text, kept):
    from metaclaw.redact import mask_personal

    assert mask_personal(text) == kept
