"""``ctl``: the command line over the blocking control client."""
