# Sourced by the tools/* wrappers: sets repo_root and python (the project venv's interpreter that
# tools/bootstrap made, else python3 from PATH) and puts the repository on PYTHONPATH.
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${DSPARK_VENV:-.venv}"
[[ "$venv" == /* ]] || venv="$repo_root/$venv"
python="$venv/bin/python"
[[ -x "$python" ]] || python=python3
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
