"""Celery's formats, pure: task and result messages, codecs, AMQP fields, ids, rate strings."""
