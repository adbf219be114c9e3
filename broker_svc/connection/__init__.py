"""The blocking broker connection (pika): I/O thread, confirms, outbox.

Empty on purpose: ``broker_svc.app`` imports ``pending`` from here without loading pika.
"""
