"""The daemon's parts: state, run loop, lifecycle, request handlers, socket server, registry.

It is started by :mod:`gpushare.roots.daemon`, the composition root above ``daemon/`` and ``sim/``.
"""
