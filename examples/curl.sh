#!/usr/bin/env sh
# Streamed and non-streamed requests against `make serve` with curl.
set -eu
URL=${URL:-http://127.0.0.1:8000}

curl -s "$URL/v1/chat/completions" -H 'content-type: application/json' -d '{
  "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "temperature": 0
}'
echo

curl -sN "$URL/v1/completions" -H 'content-type: application/json' -d '{
  "prompt": "Shall I compare thee to a summer'"'"'s day?",
  "max_tokens": 32,
  "stream": true,
  "stream_options": {"include_usage": true}
}'
