"""The image's health check finds the admin port the way `serve` does: a flag beats the variable."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError
from proxy.healthcheck import admin_url, is_serve

SCRIPT = ["/opt/venv/bin/python", "/opt/venv/bin/streamwarden"]
UP = ["--upstream", "http://backend:8000"]


@pytest.mark.parametrize(
    ("argv", "environ", "url"),
    [
        ([*SCRIPT, "serve", *UP], {}, "http://127.0.0.1:9464/healthz"),
        ([*SCRIPT, "serve"], {"STREAMWARDEN_UPSTREAM": "http://b", "STREAMWARDEN_ADMIN_PORT": "9500"},
         "http://127.0.0.1:9500/healthz"),
        ([*SCRIPT, "serve", *UP, "--admin-port", "19467"], {"STREAMWARDEN_ADMIN_PORT": "9500"},
         "http://127.0.0.1:19467/healthz"),
        ([*SCRIPT, "serve", *UP, "--admin-port=19467"], {}, "http://127.0.0.1:19467/healthz"),
        (["python", "-m", "proxy", "serve", *UP, "--admin-port", "19467"], {}, "http://127.0.0.1:19467/healthz"),
        ([*SCRIPT, "serve", *UP, "--host", "10.1.2.3"], {}, "http://10.1.2.3:9464/healthz"),
        ([*SCRIPT, "serve", *UP, "--host", "::"], {}, "http://[::1]:9464/healthz"),
        ([*SCRIPT, "serve", *UP], {"STREAMWARDEN_HOST": "0.0.0.0"}, "http://127.0.0.1:9464/healthz"),
        ([*SCRIPT, "serve", *UP, "--host", "10.1.2.3", "--admin-host", "127.0.0.1"], {},
         "http://127.0.0.1:9464/healthz"),
        ([*SCRIPT, "serve", *UP], {"STREAMWARDEN_ADMIN_HOST": "10.9.9.9"}, "http://10.9.9.9:9464/healthz"),
    ],
)
def test_admin_url_follows_flags_then_environment(argv: list[str], environ: dict[str, str], url: str) -> None:
    assert admin_url(argv, environ) == url


def test_a_container_not_serving_has_nothing_to_check() -> None:
    assert admin_url([*SCRIPT, "fake-upstream", "--port", "8000"], {}) is None


@pytest.mark.parametrize(
    "argv", [[*SCRIPT, "serve", *UP, "--admin-port", "huge"], [*SCRIPT, "serve"], [*SCRIPT, "serve", "--admin-port"]]
)
def test_an_unusable_command_line_is_unhealthy(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        admin_url(argv, {})


@pytest.mark.parametrize(
    ("argv", "serving"),
    [
        ([*SCRIPT, "serve"], True),
        (["python", "-m", "proxy", "serve"], True),
        (["/sbin/docker-init", "--", "streamwarden", "serve", *UP], True),  # docker run --init
        (["/bin/sh", "-c", "streamwarden serve --admin-port 19467"], False),  # the shell; its child is found
        ([*SCRIPT, "fake-upstream"], False),
        (["python", "-c", "pass", "serve"], False),
        ([], False),
    ],
)
def test_the_serve_process_is_told_by_its_command_line(argv: list[str], serving: bool) -> None:
    assert is_serve(argv) is serving
