"""What the benches and the tests share: real daemons, accounts, trusted directories, faults.

``bench/`` never imports ``tests/`` (``tests/test_bench_imports.py`` enforces it), so whatever a
bench needs lives here and the tests import it from here: starting a real daemon
(:mod:`bench.support.daemon_helpers`), real unprivileged accounts (:mod:`bench.support.accounts`),
directories the daemon trusts (:mod:`bench.support.trusted`), cgroup and MPS helpers, disk and
lock faults, the registry's crash points, the lock-holding script (:mod:`bench.support.holder`),
builders of observations and samples (:mod:`bench.support.observations`) and the fake pynvml
library (:mod:`bench.support.fake_nvml`: a fake of an outside library, not of a gpushare Protocol;
those are in ``tests/fakes/``).

One dependency goes the other way and is not an import: :class:`bench.support.daemon_helpers.DaemonProc`
runs ``python -m tests.support.daemon_proc``, the real daemon wired to the Protocol fakes of
``tests/fakes/`` (fake GPUs and MPS), as a separate program.
"""
