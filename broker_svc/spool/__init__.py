"""The producer's disk spool (``Settings.spool_dir``): buffer, segment files, drain.

Empty on purpose: only an app with ``spool_dir`` set imports what is in here.
"""
