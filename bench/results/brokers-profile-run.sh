#!/bin/bash
# One run of `python -m bench.e2e burst` (the 100,000 no-op burst of docs/benchmarks.md,
# -c high=8,default=256,slow=8) on Redis or on a fresh RabbitMQ vhost; with PROFILE=1, py-spy
# records the ax-worker and the ax-scheduler for 10 s once the burst has started (the first
# task RUNNING or SUCCESS in the e2e scratch database).
#   bench/results/brokers-profile-run.sh redis|rabbitmq N TAG [PROFILE] [IDLE]
set -u
broker=$1 n=$2 tag=$3 profile=${4:-0} idle=${5:-0}
cd /work/main
vhost=""
if [ "$broker" = rabbitmq ]; then
  vhost=axbench_$tag
  rabbitmqctl delete_vhost "$vhost" >/dev/null 2>&1
  rabbitmqctl add_vhost "$vhost" >/dev/null && rabbitmqctl set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null
  url="amqp://guest:guest@127.0.0.1:5672/$vhost"
else
  url="redis://127.0.0.1:6379/0"
fi
echo "$tag $broker n=$n start $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
.venv/bin/python -m bench.e2e burst --n "$n" -c high=8,default=256,slow=8 --broker "$url" \
  --logs "/tmp/axb-$tag" > "/tmp/axb-$tag.out" 2>&1 &
e2e=$!
if [ "$profile" = 1 ]; then
  until [ "$(psql -h 127.0.0.1 -U postgres -X -Atq -d ax_bench_e2e_burst -c \
      "SELECT count(*) FROM ax_task WHERE status IN ('RUNNING','SUCCESS')" 2>/dev/null)" -gt 0 ] 2>/dev/null; do
    kill -0 $e2e 2>/dev/null || break
    sleep 0.2
  done
  worker=$(ps --ppid $e2e -o pid=,args= | grep ax-worker | awk '{print $1}')
  sched=$(ps --ppid $e2e -o pid=,args= | grep ax-scheduler | awk '{print $1}')
  extra=""; [ "$idle" = 1 ] && extra="--idle"
  echo "$tag burst started $(date -u +%H:%M:%S.%N | cut -c1-12) worker=$worker scheduler=$sched load $(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/py-spy record --pid "$worker" --duration 10 --rate 100 --nonblocking --threads $extra \
    --format raw -o "bench/results/pyspy-$tag-worker.txt" >/dev/null 2>&1 &
  p1=$!
  .venv/bin/py-spy record --pid "$sched" --duration 10 --rate 100 --nonblocking --threads $extra \
    --format raw -o "bench/results/pyspy-$tag-scheduler.txt" >/dev/null 2>&1 &
  p2=$!
  sleep 4
  .venv/bin/py-spy dump --pid "$worker" --nonblocking > "/tmp/axb-$tag-worker-dump.txt" 2>&1
  wait $p1 $p2
fi
wait $e2e
echo "$tag end $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg): $(tail -1 /tmp/axb-$tag.out)"
[ -n "$vhost" ] && rabbitmqctl delete_vhost "$vhost" >/dev/null 2>&1
exit 0
