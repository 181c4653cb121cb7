#!/bin/sh
# `make run`: streamwarden in front of UPSTREAM, or of the built-in fake upstream when none is given.
set -eu
fake_pid=""
cleanup() { [ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null; return 0; }
trap cleanup EXIT INT TERM

if [ -z "$UPSTREAM" ]; then
  UPSTREAM="http://127.0.0.1:$FAKE_PORT"
  "$BIN/streamwarden" fake-upstream --port "$FAKE_PORT" &
  fake_pid=$!
  "$BIN/python" - "$FAKE_PORT" <<'PY'
import socket, sys, time
deadline = time.monotonic() + 15
while True:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the fake upstream did not start")
        time.sleep(0.1)
PY
  echo "fake upstream: $UPSTREAM  (faults: add the header 'x-fault: NAME', see README)"
fi

cat <<MSG
streamwarden: http://127.0.0.1:$PORT  ->  $UPSTREAM
admin:        http://127.0.0.1:$ADMIN_PORT/metrics  /healthz  /readyz

Try:
  curl -N http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  curl -N http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' -H 'x-fault: stray_503' \\
    -d '{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  export OPENAI_BASE_URL=http://127.0.0.1:$PORT/v1 OPENAI_API_KEY=unused
  export ANTHROPIC_BASE_URL=http://127.0.0.1:$PORT ANTHROPIC_API_KEY=unused
Stop with Ctrl-C.
MSG

"$BIN/streamwarden" serve --upstream "$UPSTREAM" --host 127.0.0.1 --port "$PORT" --admin-port "$ADMIN_PORT" \
  --log-format console
