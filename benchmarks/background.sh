#!/usr/bin/env bash
# Long GPU jobs that outlast one device call: started in their own process session (the device ends a call's other
# processes when it returns), they run on while later calls carry model parts, and a later call waits for them.
#
#   benchmarks/background.sh start NAME COMMAND...   -> runs COMMAND; /tmp/bg/NAME.log, then /tmp/bg/NAME.rc
#   benchmarks/background.sh wait NAME [SECONDS]      -> until NAME ends (or SECONDS pass); prints its log's tail
#   benchmarks/background.sh status                   -> each job: running, or its exit code
#   benchmarks/background.sh stop NAME                -> SIGTERM to every process of the job's session: its shell loops
#                       too (stopping its python processes alone lets a loop start the next run), and the runs that
#                       `timeout` moved to process groups of their own
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p /tmp/bg
case "${1:-}" in
  start)
    name=${2:?name}; shift 2
    rm -f "/tmp/bg/$name.rc"
    setsid nohup bash -c '"$@"; echo $? > "/tmp/bg/'"$name"'.rc"' _ "$@" > "/tmp/bg/$name.log" 2>&1 < /dev/null &
    echo $! > "/tmp/bg/$name.pid"  # setsid makes it a session leader: its pid is the session's id
    echo "started $name (pid $!)" ;;
  stop)
    name=${2:?name}
    pkill -TERM -s "$(cat "/tmp/bg/$name.pid")" || true
    echo "stopped $name" ;;
  wait)
    name=${2:?name}; deadline=$((SECONDS + ${3:-600}))
    while [ ! -f "/tmp/bg/$name.rc" ] && [ $SECONDS -lt $deadline ]; do sleep 2; done
    tail -5 "/tmp/bg/$name.log"
    if [ -f "/tmp/bg/$name.rc" ]; then echo "$name ended: $(cat "/tmp/bg/$name.rc")"; else echo "$name still running"; exit 1; fi ;;
  status)
    for log in /tmp/bg/*.log; do
      [ -e "$log" ] || continue
      name=$(basename "$log" .log)
      if [ -f "/tmp/bg/$name.rc" ]; then echo "$name: ended $(cat "/tmp/bg/$name.rc")"; else echo "$name: running"; fi
    done ;;
  *) sed -n '2,11p' "$0"; exit 2 ;;
esac
