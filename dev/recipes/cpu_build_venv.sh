#!/bin/bash
# Makes a virtualenv with torch's CPU build (prints pip's output and the torch it holds).
#
# A virtualenv with the CPU build of torch, to check that results and tests do not depend on the
# build (docs/benchmarks.md, "Across machines"). On this project's machines the only CPU build on
# disk is torch 2.13.0+cpu (pip's index here has the CUDA builds; download.pytorch.org is not
# reachable), and PyPI's torchvision 0.28.0 is a CUDA build whose compiled ops (_C.so: nms,
# roi_align, ...) do not load beside it: importing it fails in torchvision/_meta_registrations.py
# ("operator torchvision::nms does not exist"). vistrain uses only torchvision's Python modules
# (the RegNet blocks, transforms, IMG_EXTENSIONS), so that file's fake-tensor registrations of the
# detection ops are emptied in this venv, and in no other.
#
#   dev/recipes/cpu_build_venv.sh /tmp/cpu-venv
#   /tmp/cpu-venv/bin/python dev/recipes/recipe_seeds.py --seeds 0 --out /tmp/simclr_cpubuild
#   /tmp/cpu-venv/bin/python -m pytest -q
set -euo pipefail
VENV=${1:?usage: dev/recipes/cpu_build_venv.sh VENV_DIR}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
python -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps torchvision==0.28.0
"$VENV/bin/pip" install -q -e "$REPO[dev]"
META=$("$VENV/bin/python" -c "import importlib.util as u; print(u.find_spec('torchvision').submodule_search_locations[0])")/_meta_registrations.py
echo "# emptied by dev/recipes/cpu_build_venv.sh: the CUDA build's detection ops do not load on torch+cpu" > "$META"
"$VENV/bin/python" -c "import torch, torchvision; assert not torch.version.cuda, torch.__version__; print('torch', torch.__version__, '(CPU build), torchvision', torchvision.__version__)"
