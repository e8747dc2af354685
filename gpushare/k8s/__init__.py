"""Kubernetes: the kubelet device plugin that gives pods gpushare's MPS set-up (docs/kubernetes.md).

``gpushare k8s device-plugin`` runs :class:`gpushare.k8s.plugin.DevicePlugin` beside the daemon
in the DaemonSet. :mod:`gpushare.k8s.devices` decides what is advertised and what a container
gets (pure); :mod:`gpushare.k8s.plugin` speaks gRPC to the kubelet (stubs in
:mod:`gpushare.k8s.proto`, generated from ``api.proto`` by ``regenerate.sh``).
"""
