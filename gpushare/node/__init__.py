"""The outside world: one module per resource, each behind a Protocol in :mod:`gpushare.node.base`."""
