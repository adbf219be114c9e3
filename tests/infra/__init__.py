"""Test infrastructure: brokers and nodes for the suite and the Makefile."""
