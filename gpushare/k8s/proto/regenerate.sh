#!/bin/sh
# Regenerates api_pb2.py, api_pb2.pyi and api_pb2_grpc.py from api.proto with grpcio-tools
# (pip install grpcio-tools; its protoc and the protobuf runtime gpushare depends on must agree:
# the generated module checks the runtime's version when imported).
#   gpushare/k8s/proto/regenerate.sh [PYTHON [OUTDIR]]
# OUTDIR (default: the repository, in place) gets gpushare/k8s/proto/api_pb2*.py*.
set -eu
python=${1:-python3}
top=$(cd "$(dirname "$0")/../../.." && pwd)
out=${2:-$top}
cd "$top"
"$python" -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" gpushare/k8s/proto/api.proto
