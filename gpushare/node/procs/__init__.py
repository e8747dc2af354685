"""Processes: spawning workloads as their submitter, identity across restarts, and exit noticing.

This package owns ``/proc``, psutil, process spawning and uid switching (docs/design.md §3, D9).
Read it in this order:

* :mod:`~gpushare.node.procs.users`: login names and groups of a uid.
* :mod:`~gpushare.node.procs.spawning`: :func:`~gpushare.node.procs.spawning.spawn` runs an argv
  (never a shell) as a given uid/gid with that user's groups only, in a new session, entering the
  working directory as that user, stdin from ``/dev/null`` and stdout+stderr into a log file owned
  by the user.
* :mod:`~gpushare.node.procs.identity`: :func:`~gpushare.node.procs.identity.process_start_time`
  and :func:`~gpushare.node.procs.identity.is_same_process` tell a live client from a recycled pid
  when the daemon re-adopts clients after a restart (docs/design.md D6); a process's descendants,
  the members of a process group, and whether a process is stopped.
* :mod:`~gpushare.node.procs.facts`: :func:`~gpushare.node.procs.facts.process_facts` reads what
  adoption rules match on (uid, cgroup, systemd unit, the ``GPUSHARE_*``/``CUDA_MPS_*``
  environment) for processes gpushare did not start.
* :mod:`~gpushare.node.procs.exits`: :class:`~gpushare.node.procs.exits.ExitWatcher` notices exits
  on its own thread through pidfds (``poll``, no busy loop): children report their exit code,
  adopted non-children report ``None`` (unknowable).

Nothing is re-exported here: each name is imported from the module that defines it.
"""
