"""Pausing and killing clients through the cgroup v2 freezer; this package owns cgroupfs.

Layout (``docs/cgroups.md``)::

    <base>/                  the daemon's subtree (its delegated unit cgroup, or <mount>/gpushare)
    <base>/daemon/           the daemon itself, when <base> is its own cgroup (no-internal-process rule)
    <base>/client-<id>/      one leaf per client; the freezer, cgroup.kill and membership act on it

Read it in this order:

* :mod:`~gpushare.node.cgroups.discovery`: where the cgroup2 mount is (from ``/proc/self/mounts``:
  on hybrid hosts it is ``/sys/fs/cgroup/unified``, so it is never hard-coded), this process's own
  cgroup, the default client base, delegation, and the daemon's move into its ``daemon/`` leaf.
* :mod:`~gpushare.node.cgroups.files`: cgroupfs files read and written (one ``write()`` per value,
  the pids of a subtree, a wait on ``cgroup.events``).
* :mod:`~gpushare.node.cgroups.pauser`: :class:`~gpushare.node.cgroups.pauser.CgroupPauser`, the
  freezer over ``client-<id>/`` leaves: attach, freeze, thaw, kill, release.
* :mod:`~gpushare.node.cgroups.pid_tracker`: each client's pids tracked on change, for the control
  loop's every-tick question.
* :mod:`~gpushare.node.cgroups.route`: whether an adopted process can be frozen through its own
  cgroup (:func:`~gpushare.node.cgroups.route.freeze_route`) or needs SIGSTOP.
* :mod:`~gpushare.node.cgroups.choice`: :func:`~gpushare.node.cgroups.choice.make_pauser` picks the
  freezer, or :class:`~gpushare.node.signal_pauser.SignalPauser` where no writable cgroup v2
  exists, and says why; :func:`~gpushare.node.cgroups.choice.freezer_check` for ``gpushare doctor``.

Limit (docs/design.md §2): a frozen client issues no new GPU work, but kernels it already queued still run.

Nothing is re-exported here: each name is imported from the module that defines it. The errors and
checks both pausers share are in :mod:`gpushare.node.pauser_base`; adopted processes are paused
where they are by :mod:`gpushare.node.adopted`, through :mod:`~gpushare.node.cgroups.files`.
"""
