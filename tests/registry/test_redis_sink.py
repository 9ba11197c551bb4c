"""Redis URLs carry the password from a Kubernetes Secret: logs must never print it."""

from services.registry.redis_sink import redacted


def test_password_is_redacted_everything_else_kept():
    assert redacted("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "s3cret" not in redacted("redis://default:s3cret@r:1")
