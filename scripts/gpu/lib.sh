# Shared by the GPU scripts (source it): the engines a `bench host-overhead --keep --state STATE`
# call left up.

# engine_vars STATE: shell assignments NAME_URL, NAME_TOKEN and NAME_PID (the API server's pid)
# for every engine up in STATE, NAME upper-cased; use as `eval "$(engine_vars "$S")"`.
engine_vars() {
  python3 - "$1" <<'PY'
import json, shlex, sys
live = {e["name"]: e for e in json.load(open(sys.argv[1]))["live"]}
for name, e in live.items():
    n = name.upper()
    print(f"{n}_URL={shlex.quote(e['url'])} {n}_TOKEN={shlex.quote(e['token'] or '')} {n}_PID={int(e['pid'])}")
PY
}

# stop_engines MODEL STATE OUT: stop every engine up in STATE (for an EXIT trap).
stop_engines() {
  python3 -m bench host-overhead --model "$1" --state "$2" --out "$3" --rounds 0 >/dev/null 2>&1
}
