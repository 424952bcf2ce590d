#!/usr/bin/env bash
# kvproxy from the shell: the same chat request twice (watch X-KVProxy-Cache go from miss to
# resident), a streamed request, then kvproxy's own counters.
#
#   kvproxy serve --model default        # in another terminal
#   bash examples/curl.sh
set -euo pipefail

base="${OPENAI_BASE_URL:-http://localhost:8081/v1}"
key="${OPENAI_API_KEY:-none}"
# $1: "false" for one JSON reply, "true" for server-sent events.
body() {
  printf '{"model": "local", "max_tokens": 24, "stream": %s, "messages": [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."}]}' "$1"
}

for attempt in 1 2; do
  echo "== chat request $attempt"
  # -i prints the response headers: the X-KVProxy-* ones say what kvproxy did.
  curl -sS --fail-with-body -i "$base/chat/completions" \
    -H "Authorization: Bearer $key" -H 'Content-Type: application/json' -d "$(body false)"
  echo
done

echo "== streamed"
# -N: print each server-sent event as it arrives instead of buffering.
curl -sS --fail-with-body -N "$base/chat/completions" \
  -H "Authorization: Bearer $key" -H 'Content-Type: application/json' \
  -d "$(body true)"

echo "== kvproxy stats"
# /kvproxy/* needs the admin token only when kvproxy listens beyond loopback.
admin=()
if [[ -n "${KVPROXY_ADMIN_TOKEN:-}" ]]; then
  admin=(-H "Authorization: Bearer $KVPROXY_ADMIN_TOKEN")
fi
curl -sS --fail-with-body "${admin[@]}" "${base%/v1}/kvproxy/stats"
echo
