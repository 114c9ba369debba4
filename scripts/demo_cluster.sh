# Sourced by the demo scripts: `step`, `now`, and a local cluster for the demo: the running
# one as it is (`up` would refuse other settings than its own), else one started here and
# taken down on exit (KEEP_CLUSTER=1 keeps it); its client environment exported.
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
now() { date +%s; }

started_here=0
if ! rayfleet local env >/dev/null 2>&1; then started_here=1; fi
cleanup() {
  if [ "$started_here" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    step "rayfleet local down"
    serve shutdown -y >/dev/null 2>&1 || true
    rayfleet local down
  fi
}
trap cleanup EXIT

t=$(now)
if [ "$started_here" = 1 ]; then
  step "rayfleet local up"
  rayfleet local up --num-cpus "${DEMO_CPUS:-4}" --object-store-memory 1GB
else
  step "using the running rayfleet local cluster"
fi
eval "$(rayfleet local env)"
T_UP=$(( $(now) - t ))
