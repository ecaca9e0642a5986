# Sourced by the tools/* wrappers: sets repo_root and python, and puts the repository on PYTHONPATH.
# python is $DSPARK_PYTHON when set (the launcher passes its own interpreter to the commands it
# runs), else the project venv's interpreter that tools/bootstrap made, else python3 from PATH.
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DSPARK_VENV:-.venv}"
[[ "$venv" == /* ]] || venv="$repo_root/$venv"
python="${DSPARK_PYTHON:-$venv/bin/python}"
[[ -x "$python" ]] || python=python3
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
