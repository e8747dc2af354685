"""The ``gpushare`` command line: a thin client (parse, call, render, exit code)."""
