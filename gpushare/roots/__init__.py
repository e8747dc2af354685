"""Composition roots: where real or simulated parts are wired into something that runs.

They sit above ``daemon/`` and ``sim/`` (docs/design.md §3, "Rooms"), so that neither of those
imports the other's way of being started: ``daemon`` never imports ``sim``.

* :mod:`~gpushare.roots.daemon`: ``gpushare daemon``, real or ``--simulate``: config, logging,
  adapters, signals, run, exit status.
* :mod:`~gpushare.roots.envresolve`: what ``gpushare env`` and the Slurm TaskProlog look up (the
  config, the policy, the daemon or NVML for the GPU), shared by ``cli/`` and ``slurm.py``.

Nothing is re-exported here: each name is imported from the module that defines it.
"""
