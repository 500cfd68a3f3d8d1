# Set-up stamps of scripts/setup.sh (sourced; also tested on its own by tests/test_setup_stamp.py).
#
# A stamp records what a virtualenv was installed with:
#   $VENV/.specpilot-setup-<hash>-<extra>_<extra>_...
# <hash> covers pyproject.toml and the set-up scripts, so any change to them sets up again.
# A venv installed with a superset of the extras asked for is up to date: `make run`
# (runtime extras) right after `make test` (runtime + test extras) installs nothing.

# stamp_name HASH EXTRAS: the stamp's file name for comma-separated EXTRAS.
stamp_name() {
  echo ".specpilot-setup-$1-${2//,/_}"
}

# stamp_covers VENV HASH EXTRAS: status 0 when a stamp of HASH in VENV lists every
# extra of the comma-separated EXTRAS (in any order), 1 otherwise.
stamp_covers() {
  local venv=$1 hash=$2 extras=$3 f have e ok
  local -a want
  IFS=, read -ra want <<<"$extras"
  for f in "$venv"/.specpilot-setup-"$hash"-*; do
    [[ -f "$f" ]] || continue
    have="_${f##*/.specpilot-setup-"$hash"-}_"
    ok=1
    for e in "${want[@]}"; do
      [[ "$have" == *"_${e}_"* ]] || { ok=0; break; }
    done
    (( ok )) && return 0
  done
  return 1
}
