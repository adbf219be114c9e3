"""Celery's formats, pure: task and result messages, states, codecs, AMQP fields, ids, rate strings."""
