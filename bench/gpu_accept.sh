#!/usr/bin/env bash
# bench/gpu_accept.py on the lent GPU machine (../shared/gpu/README.md): install the wheels
# of gemmd's dependencies that machine lacks from .whl/, then run the acceptance command.
# Usage: bench/gpu_accept.sh OUTDIR [--backend nvidia|fake] [--quick]
root=$(cd "$(dirname "$0")/.." && pwd)
if compgen -G "$root/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site "$root"/.whl/*.whl \
    || exit
  export PYTHONPATH=/tmp/site:$root
else
  echo "gpu_accept.sh: no wheels in $root/.whl (see ../shared/gpu/README.md);" \
       "using the installed packages" >&2
  export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
fi
exec python3 "$root/bench/gpu_accept.py" "$@"
