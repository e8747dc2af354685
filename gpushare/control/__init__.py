"""Pure control logic: no I/O, no clock reads; ``now`` is always an argument."""
