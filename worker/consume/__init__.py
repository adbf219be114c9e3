"""One delivery: decode, admit, wait for a child, run, settle."""
