"""Kafka client construction, once: the security settings every client takes, and the producer,
consumer and admin clients built with them, so a SASL/SSL setting reaches every one. kafka-python
is imported on the first client, never at import time. Its logger (``kafka``) is set to WARNING on
the first client unless the application set its level: its INFO lines are connection chatter.

>>> security_settings({"security_protocol": "SSL"})
{'security_protocol': 'SSL'}
>>> sorted(TEXT_SECURITY_KEYS)[:2]
['sasl_kerberos_domain_name', 'sasl_kerberos_service_name']
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from sdcwatch.core.validate import check_known

__all__ = [
    "SECURITY_KEYS",
    "TEXT_SECURITY_KEYS",
    "security_settings",
    "bootstrap_servers",
    "new_producer",
    "new_consumer",
    "new_admin",
]

#: kafka-python's security settings passed through for real clusters: name -> value type when a
#: configuration file or the environment may give it, None when only code can (an object, or a
#: setting that is not the operator's to choose). Anything else is an error, not ignored.
SECURITY_KEYS: dict[str, type | None] = {
    "security_protocol": str,
    "ssl_check_hostname": bool,
    "ssl_cafile": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_crlfile": str,
    "ssl_password": str,
    "ssl_ciphers": str,
    "sasl_mechanism": str,
    "sasl_plain_username": str,
    "sasl_plain_password": str,
    "sasl_kerberos_service_name": str,
    "sasl_kerberos_domain_name": str,
    "ssl_context": None,
    "sasl_kerberos_name": None,
    "sasl_oauth_token_provider": None,
    "client_id": None,
}
#: The security settings that may be given as text (``[bus.security]`` of ``sdcwatch serve``).
TEXT_SECURITY_KEYS: dict[str, type] = {k: t for k, t in SECURITY_KEYS.items() if t is not None}


def security_settings(settings: Mapping[str, Any], where: str = "security") -> dict[str, Any]:
    """Check the pass-through kafka-python settings; an unknown key is an error naming it."""
    check_known(where, settings, SECURITY_KEYS)
    return dict(settings)


def bootstrap_servers(bootstrap: str) -> list[str]:
    """``host:port,host:port`` as the list kafka-python takes."""
    return bootstrap.split(",")


def _client(cls: Any, bootstrap: str, security: Mapping[str, Any] | None, settings: dict, *topics: str) -> Any:
    kafka_log = logging.getLogger("kafka")
    if kafka_log.level == logging.NOTSET:  # an application's own setting of it wins
        kafka_log.setLevel(logging.WARNING)
    return cls(*topics, bootstrap_servers=bootstrap_servers(bootstrap), **settings, **security_settings(security or {}))


def new_producer(bootstrap: str, security: Mapping[str, Any] | None = None, **settings: Any) -> Any:
    """A kafka-python ``KafkaProducer`` for ``bootstrap`` with the security settings."""
    from kafka import KafkaProducer

    return _client(KafkaProducer, bootstrap, security, settings)


def new_consumer(bootstrap: str, *topics: str, security: Mapping[str, Any] | None = None, **settings: Any) -> Any:
    """A kafka-python ``KafkaConsumer`` of ``topics`` for ``bootstrap`` with the security settings."""
    from kafka import KafkaConsumer

    return _client(KafkaConsumer, bootstrap, security, settings, *topics)


def new_admin(bootstrap: str, security: Mapping[str, Any] | None = None, **settings: Any) -> Any:
    """A kafka-python ``KafkaAdminClient`` for ``bootstrap`` with the security settings."""
    from kafka.admin import KafkaAdminClient

    return _client(KafkaAdminClient, bootstrap, security, settings)
