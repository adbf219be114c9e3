"""Settings for connections: failover lists, TLS options, and redaction of every password."""

from __future__ import annotations

import ssl

import pytest

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings, redact_url, split_urls


def test_a_failover_list_is_split_in_order_and_shares_one_vhost():
    settings = Settings(broker_url="amqp://u:p@a:5672/v; amqp://u:p@b:5673/v;")
    assert settings.broker_urls == ("amqp://u:p@a:5672/v", "amqp://u:p@b:5673/v")
    assert settings.virtual_host == "v"
    assert split_urls("amqp://a//") == ("amqp://a//",)


def test_a_failover_list_with_two_vhosts_is_refused():
    with pytest.raises(ConfigurationError, match="same vhost"):
        Settings(broker_url="amqp://a/one;amqp://b/two")


@pytest.mark.parametrize("url", ["redis://h", "amqp://h//;http://x", "amqp://h:port/", "", ";"])
def test_every_url_of_a_list_is_validated(url):
    with pytest.raises(ConfigurationError):
        Settings(broker_url=url)


def test_every_password_of_a_failover_list_is_redacted():
    url = "amqp://u:s3cret@a:5672/v;amqps://u:s3cret@b:5671/v"
    assert redact_url(url) == "amqp://u:***@a:5672/v;amqps://u:***@b:5671/v"
    settings = Settings(broker_url=url)
    assert "s3cret" not in repr(settings) and "s3cret" not in settings.safe_broker_url


def test_a_url_that_does_not_parse_still_hides_its_password():
    assert "s3cret" not in redact_url("amqp://u:s3cret@[bad/v")


def test_errors_about_a_bad_url_never_show_its_password():
    with pytest.raises(ConfigurationError) as info:
        Settings(broker_url="amqp://u:s3cret@h:notaport/v")
    assert "s3cret" not in str(info.value)


def test_tls_files_come_from_the_environment():
    settings = Settings.from_env(
        {
            "CLOCKWORK_BROKER_URL": "amqps://u:p@h/v",
            "CLOCKWORK_SSL_CA_FILE": "/ca.pem",
            "CLOCKWORK_SSL_CERT_FILE": "/c.pem",
            "CLOCKWORK_SSL_KEY_FILE": "/k.pem",
        }
    )
    assert (settings.ssl_ca_file, settings.ssl_cert_file, settings.ssl_key_file) == (
        "/ca.pem",
        "/c.pem",
        "/k.pem",
    )


def test_a_key_without_a_certificate_is_refused():
    with pytest.raises(ConfigurationError, match="ssl_cert_file"):
        Settings(ssl_key_file="/k.pem")


def test_plain_urls_get_no_tls_context_and_amqps_urls_a_verifying_one():
    settings = Settings(broker_url="amqp://h//;amqps://h//")
    plain, tls = settings.broker_urls
    assert settings.tls_context(plain) is None
    context = settings.tls_context(tls)
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_a_given_ssl_context_wins_and_is_not_in_the_repr():
    given = ssl.create_default_context()
    settings = Settings(broker_url="amqps://h//", ssl_context=given)
    assert settings.tls_context(settings.broker_urls[0]) is given
    assert "SSLContext" not in repr(settings)


def test_tls_query_options_are_read_and_removed_from_the_url():
    settings = Settings(broker_url="amqps://h/v?cafile=/nope/ca.pem&heartbeat=5")
    assert settings.broker_urls == ("amqps://h/v?heartbeat=5",)
    with pytest.raises(ConfigurationError, match="TLS files"):
        settings.tls_context(settings.broker_url)
