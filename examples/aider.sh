#!/usr/bin/env bash
# aider (https://aider.chat) through kvproxy. Run it from the git repository to work on:
#
#   kvproxy serve --model default --ctx-size 32768    # in another terminal
#   bash /path/to/kvproxy/examples/aider.sh [more aider flags]
#
# aider talks to any OpenAI-compatible server: OPENAI_API_BASE is the base URL and the
# `openai/` prefix on the model name selects its OpenAI-compatible client (see aider's
# "OpenAI compatible APIs" page). llama-server ignores the model name after the prefix.
set -euo pipefail

export OPENAI_API_BASE="${OPENAI_BASE_URL:-http://localhost:8081/v1}"
# Any value works unless llama-server runs with --api-key; kvproxy keeps one cache per key.
export OPENAI_API_KEY="${OPENAI_API_KEY:-none}"

# --no-show-model-warnings: aider knows nothing about "openai/local" (context size, costs)
#   and would otherwise warn about it at start-up.
# --map-refresh files: rebuild the repository map only when the set of files changes. The map
#   comes before the chat history in every prompt, so a changed map makes kvproxy recompute
#   the whole history after it. aider's default (auto) re-ranks the map by the names each
#   new message mentions when building it is quick, which changes it from turn to turn.
exec aider --model openai/local --no-show-model-warnings --map-refresh files "$@"
