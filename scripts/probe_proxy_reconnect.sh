#!/usr/bin/env bash
# How soon the proxy serves again after a relaunch: `mstar serve` on a deployment (default configs/qwen3.yaml, whose
# ports 8000/8010 must be free), one of its stubs killed (the supervisor relaunches tritonserver), the proxy's
# /health polled every 0.1 s while Triton is away (as a load balancer would), then the seconds from Triton's ready
# to the proxy's first 200 on /v1/completions. Prints one line; stops the server it started.
#   bash scripts/probe_proxy_reconnect.sh [deployment.yaml] [model name]
set -u
cd "$(dirname "$0")/.."
DEPLOYMENT=${1:-configs/qwen3.yaml}
MODEL=${2:-qwen3-tiny}
setsid .venv/bin/mstar serve "$DEPLOYMENT" > /tmp/probe_proxy_reconnect.log 2>&1 &
PID=$!
trap 'kill -INT -- -$PID 2>/dev/null; wait $PID 2>/dev/null' EXIT
for _ in $(seq 1 300); do sleep 1; curl -sf localhost:8000/health > /dev/null && break; done
STUB=$(pgrep -f "triton_python_backend_stub" | head -1)
kill -9 "$STUB"
T0=$(date +%s.%N)
for _ in $(seq 1 600); do sleep 0.05; curl -sf localhost:8010/v2/health/ready > /dev/null || break; done
for _ in $(seq 1 6000); do
  sleep 0.1
  curl -s -o /dev/null localhost:8000/health
  curl -sf localhost:8010/v2/health/ready > /dev/null && break
done
T1=$(date +%s.%N)
for _ in $(seq 1 6000); do
  code=$(curl -s -o /dev/null -w "%{http_code}" localhost:8000/v1/completions -H 'content-type: application/json' \
         -d "{\"model\":\"$MODEL\",\"prompt\":\"hi\",\"max_tokens\":2}")
  [ "$code" = 200 ] && break
  sleep 0.05
done
T2=$(date +%s.%N)
python3 -c "print(f'triton ready {$T1 - $T0:.1f} s after the stub was killed; the proxy answered 200 {$T2 - $T1:.2f} s after that')"
