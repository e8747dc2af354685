"""App-reported latency, the daemon side: per-client p99 over a sliding window.

Two sources feed the same answer, a :class:`~gpushare.latency.p99.LatencyP99` per online client:
datagrams from :func:`gpushare.client.report_latency`, and Prometheus histograms
(``gpushare submit --latency-from prometheus:URL#METRIC``). Read it in this order:

* :mod:`~gpushare.latency.p99`: :class:`~gpushare.latency.p99.LatencyP99`, one client's p99 or
  why there is none, and :class:`~gpushare.latency.p99.P99Tracker`, each client's sliding window
  of reported values (nearest-rank p99).
* :mod:`~gpushare.latency.datagrams`: the latency socket's datagram (latency reports and/or
  requests in flight), :func:`~gpushare.latency.datagrams.decode_message`, the daemon side of
  :func:`gpushare.client.encode_latency` and ``encode_inflight``.
* :mod:`~gpushare.latency.receiver`: :class:`~gpushare.latency.receiver.LatencyReceiver` reads
  the datagrams from a ``SOCK_DGRAM`` Unix socket with ``SO_PASSCRED`` on, so every datagram
  carries the sender's kernel-verified pid/uid/gid (``SCM_CREDENTIALS``); an ``identify``
  callback (the daemon's is :func:`~gpushare.latency.receiver.verified_identify`) maps sender and
  the client id in the message to a client (or rejects it).
* :mod:`~gpushare.latency.prometheus`: :class:`~gpushare.latency.prometheus.PrometheusScraper`
  fetches the text exposition format from localhost only, sums the histogram's ``_bucket`` series
  over their label sets, and :class:`~gpushare.latency.prometheus.HistogramWindow` derives the p99
  over the window from bucket increases, as PromQL's
  ``histogram_quantile(0.99, increase(METRIC_bucket[window]))`` would.
* :mod:`~gpushare.latency.app`: :class:`~gpushare.latency.app.AppLatency`, both sources together:
  the per-client p99s :func:`gpushare.daemon.observe.build_observation` reads, a scraped histogram
  winning over datagrams.

Nothing is re-exported here: each name is imported from the module that defines it.
"""
